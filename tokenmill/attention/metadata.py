"""Per-step attention metadata and the scoped forward context that carries it to the model.

Token layout of one step (the runner orders decodes first):

    tokens:   [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     3 decodes, then prefill chunks of 4 and 2
    query_start_loc = [0, 1, 2, 3, 7, 9]
    seq_lens        = [17, 5, 33, 4, 130]          tokens in the cache after this step, per request
    slot_mapping[i] = block_table[pos // block_size] * block_size + pos % block_size
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
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
    derived: "DerivedPlans" = field(default_factory=lambda: DerivedPlans(), repr=False)
    """Per-step plans the attention backend derives from the fields above once and every layer reuses."""


@dataclass
class PerTokenTables:
    """Every query token as a decode over its own prefix: its request's block table and key count."""

    block_tables: torch.Tensor   # [num_tokens, max_blocks]
    seq_lens: torch.Tensor       # [num_tokens]


@dataclass
class TiledPlan:
    """A step with long prompt chunks: those requests for the tiled prefill kernel, the rest per token."""

    block_tables: torch.Tensor   # [num_long, max_blocks]
    seq_lens: torch.Tensor       # [num_long]
    q_start: torch.Tensor        # [num_long] first query row of each long request
    q_len: torch.Tensor          # [num_long]
    short: "tuple[torch.Tensor, PerTokenTables] | None"
    """(query row indices, their per-token tables) of the other requests' tokens, or None."""


@dataclass
class DerivedPlans:
    """Built by the first layer that needs them (attention/backend.py), read by the others."""

    per_token: PerTokenTables | None = None
    tiled: TiledPlan | None = None
    tiled_done: bool = False
    """tiled is final (None then means: no request is long)."""


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
