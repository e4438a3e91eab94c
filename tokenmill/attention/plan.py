"""The step's attention plan: decided once per step and KV-cache group by the runner, read by every reader (the
PyTorch backend, the C++ kernels' wrappers and the C++ layer loop), so no two places can disagree.

Two kinds:

    PER_TOKEN   every query token is attended as a decode over its own prefix: its request's block table and key
                count per token (AttentionMetadata.token_block_tables / token_seq_lens). Decodes, speculative
                verification (chains and trees), short prompt chunks, and every prompt chunk where prompts are
                attended per token (batch invariance) or the group is windowed.
    TILED       some prompt chunks have TILED_PREFILL_MIN_TOKENS or more tokens: those go to the tiled prefill
                kernel, the other requests' tokens per token (attention/backend.tiled_plan splits them).

    step: decodes a, b; chunk c of 40 tokens; chunk d of 3     tiled_prefill on, global group -> TILED (c tiled)
    the same with tiled_prefill off (batch_invariant)                                         -> PER_TOKEN
    step: decodes a, b; verification of c with 5 drafts (6 tokens)                            -> PER_TOKEN
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

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
