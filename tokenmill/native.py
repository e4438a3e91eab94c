"""tokenmill._C, the C++ kernels built from csrc/ at install, and what this process may use of them.

The ops are `torch.ops.tokenmill.<name>` (schemas in csrc/ops.cpp). Every op runs on any x86-64 CPU;
inside, AVX2, AVX-512 and AVX512-BF16 paths are chosen at run time from the CPU's features (`isa()`),
capped by TOKENMILL_ISA=generic|avx2|avx512|avx512_bf16|amx.

Each caller keeps a PyTorch reference, the oracle of its tests, and falls back to it only when `ops()`
is None: the build is missing, or TOKENMILL_NO_CPP_KERNELS=1. With TOKENMILL_REQUIRE_KERNELS=1 (CI sets
it) a missing, stale or disabled build raises `KernelsUnavailable` instead, so a broken build cannot
hide behind a slower green run. A build is stale when the csrc/ tree beside the package (a source
checkout) no longer matches the fingerprint compiled into it: rerun `bash scripts/install.sh`.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from tokenmill.native_source import source_hash

logger = logging.getLogger("tokenmill")

REQUIRE_ENV = "TOKENMILL_REQUIRE_KERNELS"
DISABLE_ENV = "TOKENMILL_NO_CPP_KERNELS"
CSRC = Path(__file__).resolve().parent.parent / "csrc"


class KernelsUnavailable(RuntimeError):
    """The C++ kernels are required (TOKENMILL_REQUIRE_KERNELS=1) but cannot be used."""


def required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def _unusable(reason: str) -> None:
    if required():
        raise KernelsUnavailable(f"{reason} ({REQUIRE_ENV}=1)")
    logger.warning("%s; using the PyTorch paths (several times slower)", reason)


@functools.cache
def module() -> ModuleType | None:
    """The loaded tokenmill._C, or None when it is missing, stale or disabled (see the module docstring)."""
    if os.environ.get(DISABLE_ENV) == "1":
        _unusable(f"C++ kernels disabled by {DISABLE_ENV}=1")
        return None
    try:
        from tokenmill import _C
    except ImportError as e:
        _unusable(f"tokenmill._C is not built or does not load ({e}); run `bash scripts/install.sh`")
        return None
    if CSRC.is_dir():
        current = source_hash(CSRC)
        if current != _C.source_hash:
            _unusable(
                f"tokenmill._C was built from other sources ({_C.source_hash}) than {CSRC} ({current}); "
                "run `bash scripts/install.sh` to rebuild"
            )
            return None
    return _C


def ops():
    """torch.ops.tokenmill when the kernels are usable, else None (the caller takes its reference path)."""
    return torch.ops.tokenmill if module() is not None else None


def available() -> bool:
    return module() is not None


ISA_LEVELS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")
"""Lowest first; each level has every instruction set of the ones before it (amx: AMX-BF16 tiles)."""


def isa() -> str:
    """The instruction sets the kernels use (one of ISA_LEVELS), or "none" without kernels."""
    m = module()
    return "none" if m is None else m.isa()


def _at_least(level: str) -> bool:
    current = isa()
    return current != "none" and ISA_LEVELS.index(current) >= ISA_LEVELS.index(level)


def has_avx2() -> bool:
    """AVX2 + FMA + F16C (every AVX-512 level has them too)."""
    return _at_least("avx2")


def has_avx512() -> bool:
    return _at_least("avx512")


def has_avx512_bf16() -> bool:
    return _at_least("avx512_bf16")


def has_amx() -> bool:
    return _at_least("amx")


def bf16_linears_batch_invariant() -> bool:
    """Whether the dense rule's bf16 linears give each row the same bits at every row count on this CPU: the
    AMX kernel, or the AVX2 kernel on a CPU without AVX-512 (where oneDNN has no bf16 path). On AVX-512
    without AMX, bf16 rows past the few-row kernel go to oneDNN, whose reduction order depends on the rows."""
    return has_amx() or (has_avx2() and not has_avx512())
