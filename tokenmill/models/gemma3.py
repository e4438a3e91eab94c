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

The C++ layer loop (csrc/decode_stack.cpp) runs these layers from `decoder_layout()`: the differences above are
its data (models/interface.py), and the norms, the GeGLU and the QK-norm run by the same kernels in both forwards
(layers/fused_ops.py), so both give the same bits.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, TorchPagedAttention
from tokenmill.config import ModelArchConfig, plan_kv_groups
from tokenmill.layers.activation import gelu_tanh_and_mul
from tokenmill.layers.embedding import VocabEmbedding
from tokenmill.layers.norm import GemmaRMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.causal_lm import CausalLM
from tokenmill.models.interface import DecoderLayerParts, DecoderLayout, LayerTaps, MlpActivation
from tokenmill.models.llama import LlamaMLP
from tokenmill.models.qwen3 import Qwen3Attention


class Gemma3Attention(Qwen3Attention):
    """Qwen3's QK-norm attention with Gemma's norm, scale, per-layer RoPE base, window and KV-cache group."""

    qk_norm_cls = GemmaRMSNorm

    def __init__(
        self,
        cfg: ModelArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
        kv_group: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(cfg, layer_idx, rotary, backend, dtype)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.sliding_window = sliding_window
        self.kv_group = kv_group


class Gemma3MLP(LlamaMLP):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype) -> None:
        if cfg.hidden_act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma 3's MLP is GeGLU with tanh GELU; hidden_act {cfg.hidden_act!r} is not supported")
        super().__init__(cfg, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
        kv_group: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
    ) -> None:
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

    def parts(self, rope: int) -> DecoderLayerParts:
        """rope: the index of this layer's RoPE table in the model's layout."""
        attn = self.self_attn
        return DecoderLayerParts(
            self.input_layernorm.weight,
            self.pre_feedforward_layernorm.weight,
            attn.qkv_proj,
            attn.o_proj,
            self.mlp.gate_up_proj,
            self.mlp.down_proj,
            q_norm=attn.q_norm.weight,
            k_norm=attn.k_norm.weight,
            attn_out_norm=self.post_attention_layernorm.weight,
            mlp_out_norm=self.post_feedforward_layernorm.weight,
            kv_group=attn.kv_group,
            rope=rope,
        )


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_scale = cfg.hidden_size**0.5
        windows = cfg.layer_windows()
        self.rotary_global = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.rotary_local = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta or 10000.0, None
        )
        group_of = {layer: g for g, grp in enumerate(plan_kv_groups(windows)) for layer in grp.layers}
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                cfg, i, self.rotary_global if w is None else self.rotary_local, w, group_of[i], backend, dtype
            )
            for i, w in enumerate(windows)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """ids -> embedded rows times sqrt(hidden) (the scale rounded to the rows' dtype first, as HF does)."""
        h = self.embed_tokens(input_ids)
        return h * torch.tensor(self.embed_scale, dtype=h.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, taps: LayerTaps | None = None) -> torch.Tensor:
        h = self.embed(input_ids)
        with self.rotary_global.cached(positions), self.rotary_local.cached(positions):
            for i, layer in enumerate(self.layers):
                h = layer(positions, h)
                if taps is not None:
                    taps.take(i, h)
        return self.norm(h)


class Gemma3ForCausalLM(CausalLM):
    """The Gemma 3 body (Gemma3Model); loading, logits and weight processing are CausalLM's (HF names, packed
    q/k/v and gate/up, tied head)."""

    def __init__(
        self, cfg: ModelArchConfig, dtype: torch.dtype = torch.float32, backend: AttentionBackend | None = None
    ) -> None:
        super().__init__(cfg, Gemma3Model(cfg, dtype, backend or TorchPagedAttention()), dtype)

    def decoder_layout(self) -> DecoderLayout:
        body = self.model
        assert isinstance(body, Gemma3Model)
        a0 = body.layers[0].self_attn
        tables = [body.rotary_global, body.rotary_local]  # DecoderLayerParts.rope indexes this list
        return DecoderLayout(
            body.embed,
            [layer.parts(tables.index(layer.self_attn.rotary)) for layer in body.layers],
            body.norm.weight,
            body.norm.eps,
            a0.num_heads,
            a0.num_kv_heads,
            a0.head_dim,
            a0.scale,
            [t.cos_sin for t in tables],
            MlpActivation.GELU_TANH,
            unit_offset_norms=True,
        )
