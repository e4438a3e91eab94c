"""Qwen3 (dense): the Llama layer with QK-norm (an RMSNorm over each head's query and key, before RoPE), no
q/k/v biases, and usually a head_dim that is not hidden_size / num_heads (config.head_dim).

The QK-norm runs in place on the packed q/k/v rows by the kernel the C++ layer loop runs too
(layers/norm.py's norm_heads_), so the loop (the layout's q_norm / k_norm, models/interface.py) and the module
path give the same bits.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import ModelArchConfig
from tokenmill.layers.norm import GemmaRMSNorm, RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.interface import DecoderLayerParts
from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    qk_norm_cls: type[RMSNorm | GemmaRMSNorm] = RMSNorm
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
        # x: [..., T, hidden]
        qkv = self.qkv_proj(x).contiguous()
        rows = qkv.view(-1, qkv.shape[-1])  # [num_tokens, (Hq + 2 Hkv) * D], a view: normed in place
        self.q_norm.norm_heads_(rows, self.num_heads)
        self.k_norm.norm_heads_(rows[:, self.q_size :], self.num_kv_heads)
        q, k, v = self.rotary.rotate_packed(positions, qkv, self.num_heads, self.num_kv_heads)
        return self.attend(q, k, v)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention

    def parts(self) -> DecoderLayerParts:
        attn = self.self_attn
        assert isinstance(attn, Qwen3Attention)
        return dataclasses.replace(super().parts(), q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight)


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
