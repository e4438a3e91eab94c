"""What every causal LM here shares around its decoder body: the LM head and logits, loading Hugging Face-named
tensors into packed linears, and the pass that readies weights after loading.

A family builds its own body (models/llama.py's LlamaModel, models/gemma3.py's Gemma3Model) and hands it to
`CausalLM.__init__`; the body is the only part that differs. What this class reads of the body:

    body(input_ids, positions) -> final-normed hidden states
    body.embed_tokens          a VocabEmbedding, or quant/head.py's QuantizedEmbedding (rows, and tied logits)
    body.layers[i].self_attn   the attention modules, each bound to its slice of the KV cache by the runner

Checkpoint names follow HF's `model.<body>` / `lm_head` layout, so the body is stored as `self.model`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.config import ModelArchConfig
from tokenmill.layers.embedding import VocabEmbedding
from tokenmill.layers.linear import Linear
from tokenmill.models.interface import DecoderLayout, LayerTaps

if TYPE_CHECKING:
    from tokenmill.models.llama import LlamaAttention  # every family's attention is one


class CausalLM(nn.Module):
    """Checkpoint tensors arrive under Hugging Face names; `packed_modules_mapping` says which
    of them are parts of a packed layer here."""

    # checkpoint suffix -> (packed module here, part index)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    lm_head: Linear | None
    """The LM head; None when the checkpoint ties it to the embedding table (compute_logits then uses the
    table, dense or quantized by quant/head.py)."""

    def __init__(self, cfg: ModelArchConfig, model: nn.Module, dtype: torch.dtype) -> None:
        """model: the family's decoder body (module docstring), built with the same cfg and dtype."""
        super().__init__()
        self.config = cfg
        self.model = model
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, taps: LayerTaps | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] (or [B, T] without a forward context) -> hidden states; `taps` also
        collects chosen layers' outputs (a block drafter's target features)."""
        return self.model(input_ids, positions, taps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab] in float32."""
        if self.lm_head is None:  # tied: the table is the head (dense, or quantized by quant/head.py)
            return self.model.embed_tokens.as_lm_head(hidden).float()
        return self.lm_head(hidden).float()

    def process_weights_after_loading(self) -> None:
        """The weights are final (load_model calls this last): every linear method, and a tied head's,
        builds the copies its kernels read. Call it again after changing weights in place."""
        for m in self.modules():
            if isinstance(m, (Linear, VocabEmbedding)):
                m.process_weights_after_loading()

    def decoder_layout(self) -> DecoderLayout | None:
        """The layers as the C++ layer loop runs them (models/interface.py), or None: this family runs the
        module path only. Each family declares which; there is no default to fall back on."""
        raise NotImplementedError(f"{type(self).__name__} declares no decoder layout")

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of parameters that received data."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            module_path, _, kind = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            if leaf in self.packed_modules_mapping:
                packed, shard = self.packed_modules_mapping[leaf]
                target = f"{parent}.{packed}"
                mod = modules.get(target)
                if not isinstance(mod, Linear):
                    raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
                mod.load_shard(kind, tensor, shard)
                loaded.add(f"{target}.{kind}")
                continue
            mod = modules.get(module_path)
            if isinstance(mod, Linear):
                mod.load_shard(kind, tensor, None)
                loaded.add(name)
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            p = params[name]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, expected {tuple(p.shape)}"
                )
            p.data.copy_(tensor.to(p.dtype))
            loaded.add(name)
        return loaded
