"""A GGUF file's metadata and tensor index, read straight from the header (dequantization stays the `gguf`
package's: `gguf.quants.dequantize`).

Why not `gguf.GGUFReader`: it builds one numpy view per element of every metadata array, and a 262k-token
vocabulary (Gemma 3: tokens, scores, token types) took it 20 s to open; this reads each array with one
`np.frombuffer` (strings: one decode each) in well under a second.

Layout (little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):

    "GGUF" | version u32 | tensor count u64 | kv count u64
    kv:     key (u64 length + utf-8) | value type u32 | value (arrays: item type u32, count u64, items)
    tensor: name | n_dims u32 | dims u64 x n_dims (innermost first) | ggml type u32 | offset u64
    padding to general.alignment (32), then the tensor data (offsets are relative to it)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types -> (struct format, numpy dtype) for the fixed-size ones.
_SCALARS: dict[int, tuple[str, Any]] = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]
    """Row-major (outermost first), as torch sees it: the file's dims reversed."""
    tensor_type: Any
    """gguf.GGMLQuantizationType."""
    data: np.ndarray
    """The raw data: float32/float16 values shaped `shape`, or uint8 bytes shaped (rows..., bytes per row)."""


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._mv = memoryview(self._buf)
        self._off = 0
        if bytes(self._take(4)) != b"GGUF":
            raise ValueError("bad magic (not a GGUF file)")
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2, 3)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar(4)
            dims = [self._scalar(10) for _ in range(n_dims)]
            infos.append((name, dims, self._scalar(4), self._scalar(10)))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._off // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, ggml_type, offset in infos:
            qtype = gguf.GGMLQuantizationType(ggml_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            shape = tuple(int(d) for d in reversed(dims))
            n = int(np.prod(dims)) if dims else 1
            nbytes = n // block * type_size
            lo = start + offset
            if lo + nbytes > len(self._buf):
                raise ValueError(f"tensor {name!r} runs past the end of the file (truncated)")
            raw = self._buf[lo : lo + nbytes]
            if qtype == gguf.GGMLQuantizationType.F32:
                data = raw.view(np.float32).reshape(shape)
            elif qtype == gguf.GGMLQuantizationType.F16:
                data = raw.view(np.float16).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
            self.tensors.append(GGUFTensor(name, shape, qtype, data))

    # ------------------------------------------------------------------ parsing
    def _take(self, n: int) -> memoryview:
        if self._off + n > len(self._mv):
            raise ValueError("the header runs past the end of the file (truncated)")
        out = self._mv[self._off : self._off + n]
        self._off += n
        return out

    def _scalar(self, vtype: int) -> Any:
        fmt, _ = _SCALARS[vtype]
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return bytes(self._take(self._scalar(10))).decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item, count = self._scalar(4), self._scalar(10)
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            if item not in _SCALARS:
                raise ValueError(f"unknown GGUF array item type {item}")
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            return np.frombuffer(self._take(count * dtype.itemsize), dtype=dtype).tolist()
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self._scalar(vtype)
