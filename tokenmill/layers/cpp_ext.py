"""Lazy, cached builds of the project's small C++ CPU kernels (torch.utils.cpp_extension.load_inline).

Each extension is compiled on first use (cached on disk by torch, ~1 min on 2 cores the first
time) and shared by every caller. If there is no compiler, the build fails, or
TOKENMILL_NO_CPP_KERNELS=1 is set, `load` returns None and callers keep their PyTorch path.
"""
from __future__ import annotations

import logging
import os
import threading
from types import ModuleType

logger = logging.getLogger("tokenmill")

_lock = threading.Lock()
_built: dict[str, ModuleType | None] = {}

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
"""-ffp-contract=off: no fused multiply-adds the PyTorch reference would not do, so kernels
can match it bit for bit."""


def disabled() -> bool:
    return os.environ.get("TOKENMILL_NO_CPP_KERNELS") == "1"


def load(name: str, decls: str, source: str, functions: list[str]) -> ModuleType | None:
    """The built extension `name`, or None when C++ kernels are unavailable or disabled."""
    if name in _built:
        return _built[name]
    with _lock:
        if name in _built:
            return _built[name]
        module = None
        if not disabled():
            try:
                from torch.utils.cpp_extension import load_inline
                module = load_inline(name=name, cpp_sources=[decls, source], functions=functions,
                                     extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # no compiler, no headers, ...
                logger.warning("C++ kernels %s unavailable (%s); using the PyTorch path", name, e)
        _built[name] = module
    return module


EXP16_SOURCE = r"""
// exp(x) for 16 floats (AVX-512): Cephes-style range reduction and a degree-6 polynomial, relative
// error ~1e-7 (std::exp's is ~1e-7 too); overflow gives +inf, x < -87 gives ~0. Shared by the
// attention softmax and SiLU; guarded so sources concatenated into one extension define it once.
#ifndef TOKENMILL_EXP16_DEFINED
#define TOKENMILL_EXP16_DEFINED
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}
#endif
#endif
"""
