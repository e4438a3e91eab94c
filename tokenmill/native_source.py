"""The fingerprint of the C++ sources (csrc/): compiled into tokenmill._C by setup.py and compared with
the tree at import (tokenmill/native.py), so a build older than its sources is noticed. No imports
beyond the standard library: setup.py loads this file before torch or the package exist."""

from __future__ import annotations

import hashlib
from pathlib import Path

SUFFIXES = (".cpp", ".h")


def source_hash(csrc: Path) -> str:
    """sha256 over every .cpp/.h file under csrc, by relative path and content, first 16 hex digits."""
    digest = hashlib.sha256()
    for path in sorted(p for p in csrc.rglob("*") if p.suffix in SUFFIXES):
        digest.update(path.relative_to(csrc).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
