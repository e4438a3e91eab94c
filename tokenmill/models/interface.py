"""What a model tells the worker about its decoder layers, so the C++ layer loop (worker/cpu_decode.py)
can run them without looking inside the modules.

A model whose layers are the pre-norm layer below returns a `DecoderLayout` from `decoder_layout()`; a model
with another layout returns None and runs the module path only. The families differ by data, not by loops:

    Llama, Mistral, Qwen2      the layer as written (Qwen2: q/k/v biases, carried by the qkv linear)
    Qwen3                      + q_norm, k_norm
    Gemma 3                    + q_norm, k_norm, attn_out_norm, mlp_out_norm; unit_offset_norms; GELU_TANH;
                               the embedding scaled inside `embed`; two RoPE tables; windowed KV-cache groups
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import torch

from tokenmill.layers.linear import Linear


class MlpActivation(IntEnum):
    """The MLP's gate activation; the numbers are csrc/decode_stack.h's."""

    SILU = 0
    """SwiGLU: silu(gate) * up (Llama, Qwen)."""
    GELU_TANH = 1
    """GeGLU: gelu(gate, tanh approximation) * up (Gemma)."""


class LayerTaps:
    """A forward's request for the residual stream after chosen decoder layers (a block drafter's target features):
    the body (and the C++ layer loop) writes layer `layers[j]`'s output into columns j*H .. (j+1)*H of `rows`.
    Passing none costs nothing; the forward itself is unchanged.

        layers (2, 15, 29), 5 tokens, H 576  ->  rows [5, 1728]: [:, 0:576] after layer 2, [:, 576:1152] after 15, ...
    """

    def __init__(self, layers: tuple[int, ...], hidden_size: int) -> None:
        self.layers = layers
        self.hidden_size = hidden_size
        self.rows: torch.Tensor | None = None
        """[T, len(layers) * H] in the activations' dtype, made by the forward's first `buffer` call."""
        self.column = {layer: j for j, layer in enumerate(layers)}
        """layer index -> its slot in `rows`."""

    def buffer(self, h: torch.Tensor) -> torch.Tensor:
        """`rows`, made on first call for the rows of h ([T, H] or [B, T, H])."""
        if self.rows is None:
            self.rows = h.new_empty(h.numel() // self.hidden_size, len(self.layers) * self.hidden_size)
        return self.rows

    def take(self, layer: int, h: torch.Tensor) -> None:
        """The module path: layer `layer`'s output h [T, H] or [B, T, H] (kept only when asked for)."""
        j = self.column.get(layer)
        if j is not None:
            H = self.hidden_size
            self.buffer(h)[:, j * H : (j + 1) * H] = h.reshape(-1, H)


@dataclass(frozen=True)
class DecoderLayerParts:
    """One layer, as LlamaDecoderLayer.forward uses it (brackets: steps a part present adds):

    x, res = input_norm(h [+ res])
    q, k, v = qkv(x);  [q, k = q_norm(q), k_norm(k) per head];  q, k = rope(q, k)
    h = o(attention(q, k, v));  [h = attn_out_norm(h)]
    x, res = mlp_norm(h + res);  h = down(act(gate) * up),  gate | up = gate_up(x);  [h = mlp_out_norm(h)]"""

    input_norm: torch.Tensor
    """[hidden]: before attention."""
    mlp_norm: torch.Tensor
    """[hidden]: before the MLP, on the residual sum (Llama's post_attention_layernorm, Gemma's
    pre_feedforward_layernorm)."""
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    q_norm: torch.Tensor | None = None
    """[head_dim]: QK-norm of every query head before RoPE (Qwen3, Gemma 3); None: none."""
    k_norm: torch.Tensor | None = None
    """[head_dim]: the same for every key head."""
    attn_out_norm: torch.Tensor | None = None
    """[hidden]: on the attention's output before the residual add (Gemma's post_attention_layernorm)."""
    mlp_out_norm: torch.Tensor | None = None
    """[hidden]: on the MLP's output before the residual add (Gemma's post_feedforward_layernorm)."""
    kv_group: int = 0
    """The KV-cache group whose block tables (and window: its metadata's key_start) the attention reads."""
    rope: int = 0
    """The layer's RoPE table: an index into DecoderLayout.cos_sin."""


@dataclass(frozen=True)
class DecoderLayout:
    embed: Callable[[torch.Tensor], torch.Tensor]
    """ids [n] -> embedded rows [n, hidden] (scaled, where the family scales them)."""
    layers: list[DecoderLayerParts]
    final_norm: torch.Tensor
    eps: float
    """Every norm's, the QK-norms' too."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    """The attention's score scale (head_dim^-1/2; Gemma: query_pre_attn_scalar^-1/2)."""
    cos_sin: list[torch.Tensor]
    """One [max_position, head_dim] float32 table per RoPE base: cos | sin per position (layers/rotary.py);
    each layer names its own (DecoderLayerParts.rope)."""
    activation: MlpActivation = MlpActivation.SILU
    unit_offset_norms: bool = False
    """Every norm weight applies as 1 + w, the norm in float32 with one rounding (Gemma's, layers/norm.py)."""

    @property
    def num_kv_groups(self) -> int:
        return 1 + max(p.kv_group for p in self.layers)
