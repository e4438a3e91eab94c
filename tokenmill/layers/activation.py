from __future__ import annotations

from tokenmill.layers.fused_ops import silu_and_mul

__all__ = ["silu_and_mul"]
