"""The token embedding, which is also the LM head when the model ties them.

Both kinds of table here, this dense one and quant/head.py's `QuantizedEmbedding`, answer the same three
calls: `forward(ids)` (rows), `as_lm_head(hidden)` (logits) and `dense_table()`, so no caller asks
which it holds.
The dense table's logits go through a `UnquantizedLinearMethod` of its own (layers/linear.py): on CPU
in bf16 the same kernels, and the same batch-invariant AMX path, as every other dense linear.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.linear import UnquantizedLinearMethod


class VocabEmbedding(nn.Embedding):
    """nn.Embedding [vocab, hidden] that can serve as a tied LM head."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype=dtype)
        self.weight.requires_grad_(False)
        self.bias: torch.Tensor | None = None
        """Always None; read by the head's linear method, as of a Linear."""
        self.head_method = UnquantizedLinearMethod()

    @property
    def out_features(self) -> int:
        """As a head: one logit per vocabulary row."""
        return self.num_embeddings

    def process_weights_after_loading(self) -> None:
        self.head_method.process_weights_after_loading(self)

    def as_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., vocab] in the table's dtype."""
        return self.head_method.apply(self, hidden)

    def dense_table(self) -> torch.Tensor:
        """The whole table [vocab, hidden] as dense values (a read-only view here)."""
        return self.weight.detach()
