"""Linear layers with a quantization hook.

A `Linear` owns its parameters; *how* it multiplies is delegated to its `LinearMethod`
(`UnquantizedLinearMethod` by default; quant/ installs int8/int4 weight-only methods). A method has
three duties:

    process_weights_after_loading(layer)   once the weights are final (load_model calls it): build
                                           whatever copies its kernels read (bf16: the VNNI and
                                           oneDNN layouts)
    apply(layer, x)                        y = x W^T + b, the module path
    kernel(layer)                          a `LinearKernel` saying which kernel serves the layer and
                                           on what tensors, for the C++ layer loop
                                           (worker/cpu_decode.py), or None where that loop cannot
                                           run it; for any row count up to `max_rows`, the loop's
                                           call gives the bits `apply` gives

Packed layers (qkv_proj, gate_up_proj) record the sizes of their logical parts in `output_sizes` so
loaders can write each checkpoint tensor into its rows and quantizers can split them back out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import fused_ops

ANY_ROWS = 1 << 62
"""LinearKernel.max_rows of a kernel whose result `apply` reproduces at every row count."""


class KernelKind(enum.IntEnum):
    """The C++ layer loop's linear kinds (csrc/decode_stack.h, LinearKind)."""

    DENSE = 0
    """fused_ops.dense_linear's rule: weight [N, K], aux = the VNNI copy, extra = oneDNN's prepacked copy."""
    INT4_TINYGEMM = 1
    """torch's int4 CPU kernel: weight = its packed codes, aux = scales_and_zeros [G, N, 2], group = group size."""
    INT4_K64 = 2
    """our int4 kernel (quant/cpu_int4.py): weight = k64 codes, aux = scales_and_zeros [N, G, 2], group."""
    INT8 = 3
    """our per-channel int8 GEMV: weight = int8 codes, aux = scales [N], extra = offsets [N] or None."""
    GGUF = 4
    """GGUF blocks as the file holds them (quant/gguf.py): parts = each checkpoint tensor's blocks, part_types
    their ggml types; bias optional."""


@dataclass(frozen=True)
class LinearKernel:
    """Which kernel computes a layer's y = x W^T (+ bias), and the tensors it reads."""

    kind: KernelKind
    weight: torch.Tensor
    aux: torch.Tensor | None
    extra: torch.Tensor | None
    bias: torch.Tensor | None
    group: int
    out_features: int
    max_rows: int
    """The most rows a call may have for this kernel to give `apply`'s result (ANY_ROWS: no limit)."""
    parts: tuple[torch.Tensor, ...] = ()
    """GGUF only: each part's blocks [rows, row bytes] uint8, filling the output columns in order."""
    part_types: tuple[int, ...] = ()
    """GGUF only: each part's ggml type."""


class LinearMethod(Protocol):
    """How a Linear computes y = x W^T + b (see the module docstring)."""

    def process_weights_after_loading(self, layer: Linear) -> None: ...

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...

    def kernel(self, layer: Linear) -> LinearKernel | None: ...


class UnquantizedLinearMethod:
    """Dense weights. One instance per layer: it holds the copies its kernels read.

    On CPU in bf16, `process_weights_after_loading` builds the VNNI copy our kernels read (AMX at any
    row count, the VNNI kernel at a few rows: layers/fused_ops.py) and oneDNN's prepacked copy (oneDNN
    reorders an unpacked bf16 weight on every call: 0.32 ms vs 0.06 ms for a [3072, 576] layer at one
    row here). float32 weights need no copy."""

    def __init__(self) -> None:
        self.vnni: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight
        self.vnni = self.packed = None
        if w is None or w.device.type != "cpu" or w.dtype != torch.bfloat16:
            return
        self.vnni = fused_ops.pack_vnni(w)
        self.packed = fused_ops.pack_onednn(w)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, layer.weight, layer.bias)
        x2 = x.reshape(-1, x.shape[-1])
        y = fused_ops.dense_linear(x2, layer.weight, self.vnni, self.packed, layer.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def kernel(self, layer: Linear) -> LinearKernel | None:
        w = layer.weight
        if (
            w is None
            or w.device.type != "cpu"
            or w.dtype not in (torch.float32, torch.bfloat16)
            or not fused_ops.is_available()
        ):
            return None
        return LinearKernel(KernelKind.DENSE, w, self.vnni, self.packed, layer.bias, 0, layer.out_features, ANY_ROWS)


class Linear(nn.Module):
    """y = x W^T + b with W: [out_features, in_features].

    output_sizes: for a packed layer, the row counts of its parts in order, e.g. [q, k, v].
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        output_sizes: list[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.output_sizes = list(output_sizes) if output_sizes else [out_features]
        assert sum(self.output_sizes) == out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.quant_method: LinearMethod = UnquantizedLinearMethod()
        self.quant_bits: int | None = None
        """Bits of the quantized weight (set with a quantized method), None for dense weights."""
        self.register_buffer("col_perm", None, persistent=False)
        """Act-order weights: the column order that makes every quantization group contiguous (quant/kernels.py)."""

    def shard_rows(self, shard_id: int) -> slice:
        """Row range of logical part `shard_id` inside the packed weight."""
        start = sum(self.output_sizes[:shard_id])
        return slice(start, start + self.output_sizes[shard_id])

    def load_shard(self, name: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        """Copy a checkpoint tensor (weight or bias) into this layer, into part `shard_id` if packed."""
        param = self.weight if name == "weight" else self.bias if name == "bias" else None
        if param is None:
            if name == "bias" and not bool(loaded.any()):
                return  # NOTE: AutoGPTQ writes an all-zero bias for every quantized layer; it adds nothing
            raise ValueError(f"checkpoint has a {name} for a layer built without one")
        target = param.data if shard_id is None else param.data[self.shard_rows(shard_id)]
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(
                f"shape mismatch for {name}: checkpoint {tuple(loaded.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(loaded.to(target.dtype))

    def process_weights_after_loading(self) -> None:
        """The weights are final: let the method build what its kernels read (again after any change)."""
        self.quant_method.process_weights_after_loading(self)

    def kernel(self) -> LinearKernel | None:
        return self.quant_method.kernel(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        return self.quant_method.apply(self, x)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, parts={self.output_sizes}, "
            f"method={type(self.quant_method).__name__}"
        )
