"""The Llama family (Llama 2/3, SmolLM, Mistral-style, Qwen2 with q/k/v biases; Qwen3 adds QK-norm: qwen3.py).

Declarative: layers only. Batching lives in the runner; attention reads the per-step metadata
from the forward context and its layer's slice of the paged KV cache.

Inputs are flattened tokens: input_ids [num_tokens], positions [num_tokens]. Outside a
forward context (quantization, perplexity) the same forward runs dense causal attention over
one sequence [T] or a batch [B, T].
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, TorchPagedAttention
from tokenmill.attention.metadata import get_forward_context
from tokenmill.config import ModelArchConfig
from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.embedding import VocabEmbedding
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.causal_lm import CausalLM
from tokenmill.models.interface import DecoderLayerParts, DecoderLayout, LayerTaps


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            cfg.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=cfg.attention_bias,
            output_sizes=[self.q_size, self.kv_size, self.kv_size],
            dtype=dtype,
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, dtype=dtype)
        self.rotary = rotary
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None  # bound by the runner: [2, nb, bs, Hkv, D]
        self.sliding_window: int | None = None
        """A window layer's window (Gemma 3); None: every earlier key."""
        self.kv_group = 0
        """The KV-cache group whose block table this layer reads (the forward context holds one per group)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [..., Hq, D], k / v [..., Hkv, D] after RoPE -> the output projection's result."""
        o = self.backend.forward(
            q, k, v, self.kv_cache, get_forward_context(self.kv_group), self.scale, self.sliding_window
        )
        return self.o_proj(o.reshape(*q.shape[:-2], self.q_size))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x: [..., T, hidden]
        q, k, v = self.rotary.rotate_packed(positions, self.qkv_proj(x), self.num_heads, self.num_kv_heads)
        return self.attend(q, k, v)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * i, bias=cfg.mlp_bias, output_sizes=[i, i], dtype=dtype)
        self.down_proj = Linear(i, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """The one definition of a layer: `forward` is the module path, and `parts()` hands the same norms
    and linears to the C++ layer loop (csrc/decode_stack.cpp), which runs this forward's steps in
    order with the kernels each linear's method names (tests/worker/test_cpu_decode.py checks that
    both give the same tokens)."""

    attention_cls: type[LlamaAttention] = LlamaAttention
    """The attention module a family's layer uses (Qwen3: QK-norm, models/qwen3.py)."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = self.attention_cls(cfg, layer_idx, rotary, backend, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, dtype)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x, h = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(h)), h)
        return h + self.mlp(x)

    def parts(self) -> DecoderLayerParts:
        return DecoderLayerParts(
            self.input_layernorm.weight,
            self.post_attention_layernorm.weight,
            self.self_attn.qkv_proj,
            self.self_attn.o_proj,
            self.mlp.gate_up_proj,
            self.mlp.down_proj,
        )


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        """A VocabEmbedding, or quant/head.py's QuantizedEmbedding: both serve rows and tied logits."""
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(layer_cls(cfg, i, rotary, backend, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = rotary  # shared by every layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, taps: LayerTaps | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        with self.rotary.cached(positions):
            for i, layer in enumerate(self.layers):
                h = layer(positions, h)
                if taps is not None:
                    taps.take(i, h)
        return self.norm(h)


class LlamaForCausalLM(CausalLM):
    """The Llama body (LlamaModel) of `layer_cls` layers; loading, logits and weight processing are CausalLM's."""

    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(
        self, cfg: ModelArchConfig, dtype: torch.dtype = torch.float32, backend: AttentionBackend | None = None
    ) -> None:
        super().__init__(cfg, LlamaModel(cfg, dtype, backend or TorchPagedAttention(), self.layer_cls), dtype)

    def decoder_layout(self) -> DecoderLayout:
        a0 = self.model.layers[0].self_attn
        return DecoderLayout(
            self.model.embed_tokens,
            [layer.parts() for layer in self.model.layers],
            self.model.norm.weight,
            self.model.norm.eps,
            a0.num_heads,
            a0.num_kv_heads,
            a0.head_dim,
            a0.scale,
            [self.model.rotary.cos_sin],
        )
