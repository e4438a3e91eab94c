"""Per-step attention metadata and the scoped forward context that carries it to the model.

Token layout of one step (the runner orders decodes first):

    tokens:   [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     3 decodes, then prefill chunks of 4 and 2
    query_start_loc = [0, 1, 2, 3, 7, 9]
    seq_lens        = [17, 5, 33, 4, 130]          tokens in the cache after this step, per request
    slot_mapping[i] = block_table[pos // block_size] * block_size + pos % block_size
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class AttentionMetadata:
    num_decodes: int
    """The first num_decodes requests (and tokens) have query length 1."""
    num_prefills: int
    slot_mapping: torch.Tensor      # [num_tokens] int64, cache slot of each new token
    block_tables: torch.Tensor      # [num_reqs, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor          # [num_reqs] int64, context length after this step
    query_start_loc: torch.Tensor   # [num_reqs + 1] int64 (device)
    # Host copies used to slice per-request work without device syncs.
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    max_decode_seq_len: int
    decode_mask: torch.Tensor | None = None   # [num_decodes, 1, 1, max_decode_len] bool, True = attend
    custom_mask: torch.Tensor | None = None
    """Seam for token trees: a [num_tokens, max_seq_len] mask replacing the causal rule."""
    token_block_tables: torch.Tensor | None = None
    """Set when every request has few new tokens (decodes, speculative verification): [num_tokens,
    max_blocks], each token's request's block table, so each token can be attended as its own decode."""
    token_seq_lens: torch.Tensor | None = None
    """With token_block_tables: [num_tokens] keys each token sees (its position + 1; causal)."""


_CONTEXT: list[AttentionMetadata] = []


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    """Make `meta` visible to attention layers for the duration of one forward pass."""
    _CONTEXT.append(meta)
    try:
        yield
    finally:
        _CONTEXT.pop()


def get_forward_context() -> AttentionMetadata | None:
    """The active metadata, or None outside a paged forward (dense causal attention)."""
    return _CONTEXT[-1] if _CONTEXT else None
