"""What a model tells the worker about its decoder layers, so the C++ layer loop (worker/cpu_decode.py)
can run them without looking inside the modules.

A model whose layers follow the pre-norm Llama layout returns a `DecoderLayout` from
`decoder_layout()`; a model with another layout returns None and runs the module path only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.layers.linear import Linear


@dataclass(frozen=True)
class DecoderLayerParts:
    """One layer, as LlamaDecoderLayer.forward uses it:

    x, res = input_norm(h [+ res]);  q, k, v = rope(qkv(x));  h = o(attention(q, k, v))
    x, res = post_norm(h + res);     h = down(silu(gate) * up),  gate | up = gate_up(x)"""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


@dataclass(frozen=True)
class DecoderLayout:
    embed: Callable[[torch.Tensor], torch.Tensor]
    """ids [n] -> embedded rows [n, hidden]."""
    layers: list[DecoderLayerParts]
    final_norm: torch.Tensor
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    cos_sin: torch.Tensor
    """[max_position, head_dim] float32: cos | sin per position (layers/rotary.py)."""
