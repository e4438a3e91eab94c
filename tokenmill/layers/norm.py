from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers import fused_ops


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 and cast back.

    With a residual: forward(x, residual) -> (norm(residual + x), residual + x), the residual
    add fused into the same kernel (inputs are not modified)."""

    unit_offset = False
    """The weight applies as is (GemmaRMSNorm's as 1 + weight); the C++ layer loop reads this as data."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):  # x: [..., hidden_size]
        if residual is None:
            return fused_ops.rms_norm(x, self.weight, self.eps)
        return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)

    def norm_heads_(self, qk: torch.Tensor, num_heads: int) -> None:
        """QK-norm in place: each of the first num_heads heads of every row of qk [N, row] (rows may be strided,
        e.g. the k heads of a packed qkv row) normed with this norm's weight [head_dim], by the kernel the C++
        layer loop runs, or the reference where it does not serve."""
        _norm_heads(qk, num_heads, self.weight, self.eps, self.unit_offset)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32, cast back at the end
    (the checkpoint stores weight - 1; a GGUF file stores 1 + weight, the loader subtracts the 1)."""

    unit_offset = True

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden_size]
        return fused_ops.rms_norm_unit_offset(x, self.weight, self.eps)

    def norm_heads_(self, qk: torch.Tensor, num_heads: int) -> None:
        """As RMSNorm.norm_heads_, with Gemma's 1 + weight."""
        _norm_heads(qk, num_heads, self.weight, self.eps, self.unit_offset)


def plain_rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS norm in plain (differentiable) torch ops, float32 inside, rounded once to x's dtype; w None: no weight.
    The draft heads' trainers and the block drafter use it, where autograd must follow and the fused kernels
    cannot."""
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y if w is None else y * w.float()).to(x.dtype)


def normalize_parts(x: torch.Tensor, width: int, eps: float) -> torch.Tensor:
    """[..., n * width] -> each width-wide part RMS-normalized without a weight (plain_rms_norm): several target
    layers' outputs side by side, whose scales differ by depth, before a draft head fuses them."""
    return torch.cat([plain_rms_norm(p, None, eps) for p in x.split(width, dim=-1)], dim=-1)


def _norm_heads(qk: torch.Tensor, num_heads: int, weight: torch.Tensor, eps: float, unit_offset: bool) -> None:
    d = weight.shape[0]
    if fused_ops.head_rms_norm_inplace(qk, num_heads, d, weight, eps, unit_offset):
        return
    heads = qk[:, : num_heads * d].unflatten(-1, (num_heads, d))  # [N, num_heads, d], a view of qk
    ref = fused_ops.rms_norm_unit_offset_ref if unit_offset else fused_ops.rms_norm_ref
    heads.copy_(ref(heads, weight, eps))
