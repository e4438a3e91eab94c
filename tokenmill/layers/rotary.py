"""Rotary position embedding (RoPE), rotate-half ("neox") layout as in HF checkpoints.

Scaling types from HF configs: default, linear (positions divided by factor) and llama3
(frequency-dependent interpolation).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.layers import fused_ops


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] after applying the configured scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        # [max_position, head_dim]: cos | sin, each half-width
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1).float(), persistent=False)
        self._cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rebuild(self, device: torch.device | str) -> None:
        """Recompute the table on `device` (a model built on the meta device has none)."""
        self.cos_sin = RotaryEmbedding(self.head_dim, self.max_position, self.theta, self.scaling).cos_sin.to(device)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cs = self.cos_sin[positions].unsqueeze(-2)  # [*, 1, head_dim]
        half = self.head_dim // 2
        return cs[..., :half], cs[..., half:]

    @contextlib.contextmanager
    def cached(self, positions: torch.Tensor) -> Iterator[None]:
        """Within the block, calls with this same `positions` tensor reuse one gather of cos/sin
        (one instance serves every layer: one gather per forward pass instead of one per layer)."""
        self._cached = (positions, *self._cos_sin(positions))
        try:
            yield
        finally:
            self._cached = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [*], q: [*, num_heads, head_dim], k: [*, num_kv_heads, head_dim]."""
        c = self._cached
        cos, sin = (c[1], c[2]) if c is not None and c[0] is positions else self._cos_sin(positions)
        return fused_ops.rope_ref(q, cos, sin), fused_ops.rope_ref(k, cos, sin)

    def rotate_packed(
        self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [..., (Hq + 2 Hkv) * D] (a packed projection's output, not used elsewhere) ->
        q [..., Hq, D], k [..., Hkv, D] rotated, v [..., Hkv, D]. Rotates q and k in place in one
        kernel call when it can (layers/fused_ops.py), else out of place."""
        d = self.head_dim
        q_size, kv_size = num_heads * d, num_kv_heads * d
        lead = qkv.shape[:-1]
        flat = qkv.reshape(-1, qkv.shape[-1])
        if flat.data_ptr() == qkv.data_ptr() and fused_ops.rope_inplace(
            flat, num_heads + num_kv_heads, d, self.cos_sin, positions.reshape(-1)
        ):
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            return q.view(*lead, num_heads, d), k.view(*lead, num_kv_heads, d), v.view(*lead, num_kv_heads, d)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = self(positions, q.reshape(*lead, num_heads, d), k.reshape(*lead, num_kv_heads, d))
        return q, k, v.reshape(*lead, num_kv_heads, d)
