"""The LM head (and a tied embedding) held quantized, as llama.cpp files hold token_embd.

Why: GPTQ and AWQ checkpoints leave the LM head in fp16. For a small model with tied
embeddings that head is a large share of the weights: SmolLM2-135M's [49152, 576] table is 57 MB
of a 271 MB bf16 model, read whole at every decode step. Quantizing it with RTN at load time
(int8 per channel, or int4 with groups) cuts both the bytes in memory and the bytes each step
reads; the published GGUF of the default model itself stores token_embd as Q8_0.

A tied table becomes one `QuantizedEmbedding`: lookups dequantize the requested rows, logits use
the int4/int8 kernels of `quant/kernels.py`. An untied `lm_head` Linear is quantized in place.
Chosen by `ModelConfig.quantize_lm_head`: auto (int8, for quantized checkpoints on CPU in
bf16/fp16), int8, int4 or none. Measured on the default model's RTN-4 checkpoint (WikiText-2, 4
windows, bf16): head none 31.79 ppl / 118.5 MB, int8 31.89 (+0.3%) / 90.3 MB, int4 g64 36.77
(+16%) / 77.8 MB; so auto means int8.

A checkpoint can also carry its own quantized head (`tokenmill quantize --lm-head`: GPTQ on the
final hidden states, saved as lm_head.qweight/qzeros/scales/g_idx with "lm_head": true). Then
`install_head_weight` builds the same `QuantizedEmbedding` from those codes; with auto (and
load_model's default, "checkpoint") that head wins over load-time RTN, while none / int8 / int4
still mean an fp16 / RTN head made from the checkpoint's fp16 embedding table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.quant.grid import QuantizedWeight
from tokenmill.quant.kernels import dequantize_rows, install_quantized
from tokenmill.quant.rtn import rtn_quantize_weight

if TYPE_CHECKING:
    from tokenmill.models.causal_lm import CausalLM  # the common base of every model class

CHOICES = ("auto", "none", "int8", "int4")
CHECKPOINT = "checkpoint"
"""load_model's default: the head as the checkpoint stores it (its quantized lm_head if it has one,
else the fp16 table), no load-time RTN."""
INT4_GROUP = 64


class QuantizedEmbedding(nn.Module):
    """Embedding rows and LM-head logits from one quantized [vocab, hidden] table.

    weight: the dense table (quantized here with RTN, `bits`), or an already quantized table
    (a QuantizedWeight, e.g. the checkpoint's GPTQ head; `bits` is then ignored)."""

    def __init__(self, weight: torch.Tensor | QuantizedWeight, bits: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        qw = weight if isinstance(weight, QuantizedWeight) else quantize_table(weight, bits)
        vocab, hidden = qw.out_features, qw.in_features
        self.embedding_dim = hidden
        self.dtype = dtype
        self.head = Linear(hidden, vocab, dtype=dtype)
        install_quantized(self.head, qw, dtype)
        # NOTE: only the quantizer sets this (the fp16 table save_quantized writes as
        # model.embed_tokens.weight for other loaders); a loaded model never holds the dense table.
        self.checkpoint_table: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [*] -> [*, hidden] in the model dtype."""
        rows = dequantize_rows(self.head, ids.reshape(-1), self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def as_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def dense_table(self) -> torch.Tensor:
        """The whole table [vocab, hidden] dequantized (a new tensor)."""
        return self(torch.arange(self.head.out_features, device=self.head.qweight.device))


def quantize_table(weight: torch.Tensor, bits: int):
    """RTN: int8 symmetric per row (the int8 kernel's form), int4 asymmetric in groups of 64."""
    if bits == 8:
        return rtn_quantize_weight(weight.float(), 8, -1, sym=True)
    if bits == 4:
        return rtn_quantize_weight(weight.float(), 4, INT4_GROUP, sym=False)
    raise ValueError(f"LM-head quantization supports 4 or 8 bits, got {bits}")


def resolve_bits(choice: str, checkpoint_bits: int | None) -> int | None:
    """quantize_lm_head setting + the checkpoint's weight bits (None if unquantized) -> bits or None."""
    if choice not in CHOICES:
        raise ValueError(f"quantize_lm_head must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "none" or (choice == "auto" and checkpoint_bits is None):
        return None
    if choice == "auto":
        return 8  # measured: an int4 (g64) head costs the default model ~16% perplexity, int8 ~0.3%
    return int(choice[3:])


def quantize_lm_head(model: CausalLM, bits: int) -> None:
    """Quantize `model`'s LM head (for tied embeddings: the shared table) with RTN."""
    embed = model.model.embed_tokens
    dtype = embed.weight.dtype
    if model.lm_head is None:  # tied
        model.model.embed_tokens = QuantizedEmbedding(embed.weight.data, bits, dtype)
    else:
        head = model.lm_head
        install_quantized(head, quantize_table(head.weight.data, bits), dtype)


def install_head_weight(model: CausalLM, qw: QuantizedWeight, keep_table: bool = False) -> None:
    """Make `qw` (an already quantized [vocab, hidden] head, e.g. GPTQ's) the model's LM head:
    for tied embeddings one QuantizedEmbedding serves lookups and logits and the dense table is
    dropped (kept aside, fp16, only with keep_table: the quantizer needs it to save the checkpoint);
    an untied lm_head Linear gets the packed weights in place."""
    embed = model.model.embed_tokens
    if model.lm_head is None:  # tied
        dtype = embed.weight.dtype
        q = QuantizedEmbedding(qw, None, dtype)
        if keep_table:
            q.checkpoint_table = embed.weight.data.to(torch.float16)
        model.model.embed_tokens = q
    else:
        install_quantized(model.lm_head, qw, model.lm_head.weight.dtype)
