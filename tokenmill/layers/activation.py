from __future__ import annotations

from tokenmill.layers.fused_ops import gelu_tanh_and_mul, silu_and_mul

__all__ = ["silu_and_mul", "gelu_tanh_and_mul"]
