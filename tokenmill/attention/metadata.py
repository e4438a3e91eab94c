"""Per-step attention metadata and the scoped forward context that carries it to the model.

Token layout of one step (the runner orders decodes first):

    tokens:   [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     3 decodes, then prefill chunks of 4 and 2
    query_start_loc = [0, 1, 2, 3, 7, 9]
    seq_lens        = [17, 5, 33, 4, 130]          tokens in the cache after this step, per request
    slot_mapping[i] = block_table[pos // block_size] * block_size + pos % block_size
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

# The step's attention plan: decided once per step and KV-cache group by the runner (plan_attention), carried
# on the metadata (AttentionMetadata.plan) and read by every reader (the PyTorch backend, the C++ kernels'
# wrappers and the C++ layer loop), so no two places can disagree. Two kinds:
#
#     PER_TOKEN   every query token is attended as a decode over its own prefix: its request's block table and key
#                 count per token (AttentionMetadata.token_block_tables / token_seq_lens). Decodes, speculative
#                 verification (chains and trees), short prompt chunks, and every prompt chunk where prompts are
#                 attended per token (batch invariance) or the group is windowed.
#     TILED       some prompt chunks have TILED_PREFILL_MIN_TOKENS or more tokens: those go to the tiled prefill
#                 kernel, the other requests' tokens per token (attention/backend.tiled_plan splits them).
#
#     step: decodes a, b; chunk c of 40 tokens; chunk d of 3     tiled_prefill on, global group -> TILED (c tiled)
#     the same with tiled_prefill off (batch_invariant)                                         -> PER_TOKEN
#     step: decodes a, b; verification of c with 5 drafts (6 tokens)                            -> PER_TOKEN

TILED_PREFILL_MIN_TOKENS = 16
"""Requests with at least this many query tokens in a step (prompt chunks) go to the tiled prefill kernel when
tiled prefill is on; every other request's tokens are attended one by one, so a generated token's attention is
the same arithmetic whether it was decoded or verified."""


class AttentionKind(enum.Enum):
    PER_TOKEN = "per_token"
    TILED = "tiled"


def plan_attention(num_new_tokens: Sequence[int], tiled_prefill: bool, windowed: bool) -> AttentionKind:
    """The kind of one KV-cache group's attention this step. num_new_tokens: per request, its query tokens;
    tiled_prefill: the model attends long prompt chunks tiled (not ModelConfig.attends_prompts_per_token);
    windowed: the group's layers have a sliding window (the tiled kernel has none)."""
    if tiled_prefill and not windowed and any(n >= TILED_PREFILL_MIN_TOKENS for n in num_new_tokens):
        return AttentionKind.TILED
    return AttentionKind.PER_TOKEN


@dataclass
class AttentionMetadata:
    num_decodes: int
    """The first num_decodes requests (and tokens) have query length 1."""
    num_prefills: int
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [num_reqs] int64, context length after this step
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64 (device)
    # Host copies used to slice per-request work without device syncs.
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    max_decode_seq_len: int
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_decode_len] bool, True = attend
    custom_mask: torch.Tensor | None = None
    """Seam for token trees: a [num_tokens, max_seq_len] mask replacing the causal rule."""
    token_block_tables: torch.Tensor | None = None
    """Set when the plan is PER_TOKEN (by the runner): [num_tokens, max_blocks], each token's request's block
    table, so each token can be attended as its own decode."""
    token_seq_lens: torch.Tensor | None = None
    """With token_block_tables: [num_tokens] keys each token sees: its slot index in its request + 1
    (its position + 1, except for the nodes of a token tree, whose positions go by depth)."""
    token_key_mask: torch.Tensor | None = None
    """Token trees: [num_tokens] int64, bit j hides the key j slots before a token's own (its listed-earlier
    non-ancestors, spec_decode/tree.py); 0 for every other token. None when the step has no tree."""
    key_start: torch.Tensor | None = None
    """Sliding-window groups: [num_tokens] int64, the first key (slot index in its request) each token sees,
    max(0, position + 1 - window); keys before it may sit in blocks already returned to the pool. None in
    groups of global layers."""
    plan: AttentionKind = AttentionKind.PER_TOKEN
    """This step's attention in this group (plan_attention), decided once by the runner: per token (the
    token_* tables are set) or tiled long prompt chunks with the other tokens per token."""
    derived: DerivedPlans = field(default_factory=lambda: DerivedPlans(), repr=False)
    """Per-step plans the attention backend derives from the fields above once and every layer reuses."""


@dataclass
class PerTokenTables:
    """Every query token as a decode over its own prefix: its request's block table and key count."""

    block_tables: torch.Tensor  # [num_tokens, max_blocks]
    seq_lens: torch.Tensor  # [num_tokens]
    key_mask: torch.Tensor | None = None  # [num_tokens] int64 (token trees), see AttentionMetadata


@dataclass
class ShortRows:
    """The query rows of a tiled step that are attended token by token (decodes, short chunks)."""

    index: torch.Tensor  # [num_short] int64, their rows in the step's tokens
    tables: PerTokenTables  # [num_short, ...] their per-token tables, in index order


@dataclass
class TiledPlan:
    """A step with long prompt chunks: those requests for the tiled prefill kernel, the rest per token."""

    block_tables: torch.Tensor  # [num_long, max_blocks]
    seq_lens: torch.Tensor  # [num_long]
    q_start: torch.Tensor  # [num_long] first query row of each long request
    q_len: torch.Tensor  # [num_long]
    short: ShortRows | None
    """The other requests' tokens, or None."""


@dataclass
class DerivedPlans:
    """Built by the first layer that needs them (attention/backend.py), read by the others."""

    per_token: PerTokenTables | None = None
    tiled: TiledPlan | None = None
    tiled_done: bool = False
    """tiled is final (None then means: no request is long)."""


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node of a token tree (parents[i]: node i's parent, -1 the root; the root's children: 1)."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def tree_key_masks(parents: list[int]) -> list[int]:
    """`token_key_mask` entries of a token tree's nodes (parents[i]: node i's parent, -1 the root). The
    nodes sit in the slots after the root in listing order, so node i's causal keys include every node
    listed before it; bit i - j hides node j unless it is one of node i's ancestors. At most 64 nodes.

        nodes  a  b (child of a)  c (child of root)  d (child of b)
        c: hides a (bit 2) and b (bit 1)  -> 0b110 = 6
        d: sees a, b; hides c (bit 1)     -> 0b010 = 2           masks [0, 0, 6, 2]
    """
    if len(parents) > 64:
        raise ValueError(f"a token tree has at most 64 nodes, got {len(parents)}")
    anc: list[int] = []  # bit j: node j is an ancestor-or-self of node i
    out: list[int] = []
    for i, p in enumerate(parents):
        a = (anc[p] if p >= 0 else 0) | (1 << i)
        anc.append(a)
        m = 0
        for j in range(i):
            if not (a >> j) & 1:
                m |= 1 << (i - j)
        out.append(m if m < (1 << 63) else m - (1 << 64))  # as int64
    return out


_CONTEXT: list[list[AttentionMetadata]] = []


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata, group_metas: Sequence[AttentionMetadata] = ()) -> Iterator[None]:
    """Make `meta` (KV-cache group 0's) and `group_metas` (groups 1.., core/kv_cache_manager.py) visible to
    attention layers for the duration of one forward pass."""
    _CONTEXT.append([meta, *group_metas])
    try:
        yield
    finally:
        _CONTEXT.pop()


def get_forward_context(group: int = 0) -> AttentionMetadata | None:
    """The active metadata of KV-cache group `group`, or None outside a paged forward (dense attention)."""
    return _CONTEXT[-1][group] if _CONTEXT else None
