"""Qwen3 (dense): the Llama layer with QK-norm (an RMSNorm over each head's query and key, before RoPE), no
q/k/v biases, and usually a head_dim that is not hidden_size / num_heads (config.head_dim).

The C++ decode loop (csrc/decode_stack.cpp) has no QK-norm step, so this family runs the module path at every
batch size: `decoder_layout()` is None and the runner builds no loop for it (a declared absence, not a
fallback: tests/models/test_numerics.py checks the runner has none).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import ModelArchConfig
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.interface import DecoderLayout
from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    qk_norm_cls: type[nn.Module] = RMSNorm
    """The per-head norm of queries and keys (Gemma 3's is GemmaRMSNorm, models/gemma3.py)."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(cfg, layer_idx, rotary, backend, dtype)
        self.q_norm = self.qk_norm_cls(self.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = self.qk_norm_cls(self.head_dim, cfg.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        lead = q.shape[:-1]
        q = self.q_norm(q.reshape(*lead, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(*lead, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(positions, q, k)
        return self.attend(q, k, v.reshape(*lead, self.num_kv_heads, self.head_dim))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer

    def decoder_layout(self) -> DecoderLayout | None:  # type: ignore[override]
        return None  # NOTE: the C++ loop has no QK-norm (module docstring)
