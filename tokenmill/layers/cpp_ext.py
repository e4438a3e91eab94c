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
