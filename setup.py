"""Builds tokenmill._C, the C++ kernels under csrc/, with torch's cpp_extension. Metadata lives in
pyproject.toml. torch must be installed first and the build run without isolation (scripts/install.sh
does both): `pip install --no-build-isolation -e .`."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def _source_hash() -> str:
    spec = importlib.util.spec_from_file_location("native_source", ROOT / "tokenmill" / "native_source.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.source_hash(CSRC)


# NOTE: no -march=native: the build must run on any x86-64 CPU. AVX-512 code is compiled inside
# target regions (csrc/isa/) and chosen at run time. -ffp-contract=off: no fused multiply-adds the
# PyTorch references would not do, so kernels can match them bit for bit.
CXX_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", f'-DTOKENMILL_SOURCE_HASH="{_source_hash()}"']

os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))

setup(
    ext_modules=[CppExtension(
        "tokenmill._C",
        sources=sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp")),
        include_dirs=[str(CSRC)],
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=["-fopenmp"],
    )],
    cmdclass={"build_ext": BuildExtension},
)
