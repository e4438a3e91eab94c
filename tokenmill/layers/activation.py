from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.fused_ops import silu_and_mul

__all__ = ["silu_and_mul", "gelu_tanh_and_mul"]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): x = gate | up on the last dim -> gelu_tanh(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
