"""Gemma 3 (text): interleaved sliding-window and global attention layers.

What differs from the Llama layer (models/llama.py), each as Hugging Face's Gemma3ForCausalLM computes it:

    h = embed(ids) * sqrt(hidden)                        (the scale cast to the weights' dtype first)
    per layer:  x = input_norm(h);  x = attention(x);  h = h + post_attention_norm(x)
                x = pre_ffn_norm(h);  x = down(gelu_tanh(gate(x)) * up(x));  h = h + post_ffn_norm(x)
    attention:  q, k = q_norm(q), k_norm(k) per head (QK-norm), then RoPE with the layer's own base
                (sliding layers 10,000, global layers rope_theta), scores scaled by query_pre_attn_scalar^-1/2;
                a sliding layer's query at position p sees keys (p - window, p]
    norms:      x / rms(x) * (1 + w), in float32 (layers/norm.py GemmaRMSNorm)
    logits = norm(h) @ embed.T                           (tied, unscaled)

Layers are split into KV-cache groups of one kind each (config.plan_kv_groups, core/kv_cache_manager.py): every
attention layer reads its group's block table and, in a sliding group, the first key each query may see
(AttentionMetadata.key_start), so the blocks a window left behind can go back to the pool.

The C++ decode loop (csrc/decode_stack.cpp) runs the Llama layout only: `decoder_layout()` is None and this
family runs the module path (declared, like Qwen3's).
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, TorchPagedAttention
from tokenmill.attention.metadata import get_forward_context
from tokenmill.config import ModelArchConfig, plan_kv_groups
from tokenmill.layers.activation import gelu_tanh_and_mul
from tokenmill.layers.embedding import VocabEmbedding
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import GemmaRMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.interface import DecoderLayout
from tokenmill.models.llama import LlamaForCausalLM


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, rotary: RotaryEmbedding, sliding_window: int | None,
                 kv_group: int, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.sliding_window = sliding_window
        self.kv_group = kv_group
        """The KV-cache group whose block table this layer reads (the forward context holds one per group)."""
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias,
                               output_sizes=[self.q_size, self.kv_size, self.kv_size], dtype=dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, dtype=dtype)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.rotary = rotary
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None  # bound by the runner: [2, nb, bs, Hkv, D]

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        lead = q.shape[:-1]
        q = self.q_norm(q.reshape(*lead, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(*lead, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(positions, q, k)
        v = v.reshape(*lead, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, self.kv_cache, get_forward_context(self.kv_group), self.scale,
                                 self.sliding_window)
        return self.o_proj(o.reshape(*lead, self.q_size))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.hidden_act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma 3's MLP is GeGLU with tanh GELU; hidden_act {cfg.hidden_act!r} is not supported")
        i = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * i, bias=cfg.mlp_bias, output_sizes=[i, i], dtype=dtype)
        self.down_proj = Linear(i, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, rotary: RotaryEmbedding, sliding_window: int | None,
                 kv_group: int, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype)
        self.self_attn = Gemma3Attention(cfg, layer_idx, rotary, sliding_window, kv_group, backend, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype)
        self.mlp = Gemma3MLP(cfg, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(h)))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_scale = cfg.hidden_size ** 0.5
        windows = cfg.layer_windows()
        self.rotary_global = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                             cfg.rope_scaling)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                            cfg.rope_local_theta or 10000.0, None)
        group_of = {layer: g for g, grp in enumerate(plan_kv_groups(windows)) for layer in grp.layers}
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, self.rotary_global if w is None else self.rotary_local, w, group_of[i],
                               backend, dtype) for i, w in enumerate(windows))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        with self.rotary_global.cached(positions), self.rotary_local.cached(positions):
            for layer in self.layers:
                h = layer(positions, h)
        return self.norm(h)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Loading, logits and weight processing are the Llama model's (HF names, packed q/k/v and gate/up)."""

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype = torch.float32,
                 backend: AttentionBackend | None = None) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = Gemma3Model(cfg, dtype, backend or TorchPagedAttention())
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)

    def decoder_layout(self) -> DecoderLayout | None:  # type: ignore[override]
        return None  # NOTE: the C++ loop runs the Llama layout only (module docstring)
