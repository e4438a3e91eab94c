"""Linear layers with a quantization hook.

A `Linear` owns its parameters; *how* it multiplies is delegated to a `LinearMethod`
(unquantized by default; quant/ adds int8/int4 weight-only methods). Packed layers (qkv_proj,
gate_up_proj) record the sizes of their logical parts in `output_sizes` so loaders can write each
checkpoint tensor into its rows and quantizers can split them back out.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(Protocol):
    """How a Linear computes y = x W^T + b. Implementations may replace the layer's weight with
    packed buffers (see quant/)."""

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor: ...


class UnquantizedLinearMethod:
    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


_UNQUANTIZED = UnquantizedLinearMethod()


class Linear(nn.Module):
    """y = x W^T + b with W: [out_features, in_features].

    output_sizes: for a packed layer, the row counts of its parts in order, e.g. [q, k, v].
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 output_sizes: list[int] | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.output_sizes = list(output_sizes) if output_sizes else [out_features]
        assert sum(self.output_sizes) == out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.quant_method: LinearMethod = _UNQUANTIZED

    def shard_rows(self, shard_id: int) -> slice:
        """Row range of logical part `shard_id` inside the packed weight."""
        start = sum(self.output_sizes[:shard_id])
        return slice(start, start + self.output_sizes[shard_id])

    def load_shard(self, name: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        """Copy a checkpoint tensor (weight or bias) into this layer, into part `shard_id` if packed."""
        param = getattr(self, name)
        if param is None:
            if name == "bias" and not bool(loaded.any()):
                return  # NOTE: AutoGPTQ writes an all-zero bias for every quantized layer; it adds nothing
            raise ValueError(f"checkpoint has a {name} for a layer built without one")
        target = param.data if shard_id is None else param.data[self.shard_rows(shard_id)]
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(loaded.shape)}, expected {tuple(target.shape)}")
        target.copy_(loaded.to(target.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        return self.quant_method.apply(self, x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, parts={self.output_sizes}, method={type(self.quant_method).__name__}"
