"""What a prompt chunk returns besides sampled tokens: prompt logprobs (SamplingParams.prompt_logprobs) and pooled
embeddings (SamplingParams.pooling), read from the final hidden states of the step's forward.

Prompt logprobs. The logits at position p predict token p + 1, so a chunk of positions [start, end) scores prompt
tokens start + 1 .. min(end, P - 1) (P prompt tokens; the logits at P - 1 sample the first output):

    prompt [t0 t1 t2 t3 t4] (P 5), chunk [0, 3): rows 0 1 2 -> logprobs of t1 t2 t3 (PromptLogprobs start_pos 1)
                                   chunk [3, 5): row 3      -> logprob of t4         (start_pos 4)

Only chunks the scheduler marks (ScheduledChunk.wants_prompt_logprobs) get logits at every position, and at most
PROMPT_LOGITS_ROWS rows at a time: what is kept per position is the prompt's own token and the top-N, never a
[num_tokens, vocab] tensor beyond one slice.

Pooling. The final hidden states (after the final norm) of a pooling request's prompt: the last token's ("last"),
or the mean over all P positions ("mean", summed chunk by chunk in the runner's row), L2-normalised, returned by
the step that computes the last prompt token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenmill.core.step_io import PromptLogprobs, StepInput, StepTokens
from tokenmill.layers.sampler import gather_logprobs

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import RequestState

PROMPT_LOGITS_ROWS = 256
"""Prompt logprobs: positions whose logits are computed at once ([256, vocab] float32 is 48 MiB for a 49,152-token
vocabulary), so a long chunk never holds its whole [num_tokens, vocab] logits."""


@dataclass
class PromptOutputs:
    """One step's prompt-side results, by request id (StepOutput.prompt_logprobs and .pooled)."""

    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)


def chunk_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    prompt_token_ids: list[int],
    start_pos: int,
    num_top: int,
) -> PromptLogprobs:
    """hidden [num_new_tokens, hidden_size]: a chunk's final hidden states from position start_pos. Each prompt token
    the chunk predicts, with its log-probability and rank under the raw model distribution, plus the top num_top."""
    end = min(start_pos + hidden.shape[0], len(prompt_token_ids) - 1)
    targets = torch.tensor(prompt_token_ids[start_pos + 1 : end + 1], dtype=torch.long, device=hidden.device)
    entries: list = []
    for a in range(0, max(0, end - start_pos), PROMPT_LOGITS_ROWS):
        b = min(end - start_pos, a + PROMPT_LOGITS_ROWS)
        logprobs = compute_logits(hidden[a:b]).log_softmax(-1)  # [b - a, vocab]
        entries.extend(gather_logprobs(logprobs, targets[a:b], [num_top] * (b - a)))
    return PromptLogprobs(start_pos + 1, entries)


def pool_chunk(row: RequestState, start_pos: int, hidden: torch.Tensor) -> list[float] | None:
    """hidden [num_new_tokens, hidden_size]: a pooling request's chunk from position start_pos. The L2-normalised
    embedding once the chunk ends the prompt, else None (mean pooling keeps its running sum in the row)."""
    num_prompt = len(row.prompt_token_ids)
    end = start_pos + hidden.shape[0]
    assert end <= num_prompt, "a pooling request computes its prompt only"
    if row.sampling_params.pooling == "mean":
        assert row.num_pooled == start_pos, "mean pooling sums every position once, from 0 (no prefix hit)"
        part = hidden.float().sum(0)  # [hidden_size]
        row.pool_sum = part if row.pool_sum is None else row.pool_sum + part
        row.num_pooled = end
        if end < num_prompt:
            return None
        vec = row.pool_sum / num_prompt
    else:
        if end < num_prompt:
            return None
        vec = hidden[-1].float()
    return torch.nn.functional.normalize(vec, dim=0).tolist()


def prompt_outputs(
    step: StepInput,
    batch: list[StepTokens],
    rows: dict[str, RequestState],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> PromptOutputs:
    """The prompt logprobs of the step's marked chunks and the embeddings its pooling requests finish.
    batch: the step's requests in input order; hidden [num_tokens, hidden_size] their rows, in that order."""
    out = PromptOutputs()
    scored = {c.request_id for c in step.scheduled if c.wants_prompt_logprobs}
    off = 0
    for s in batch:
        n = s.num_new_tokens
        row = rows[s.request_id]
        params = row.sampling_params
        if s.request_id in scored:
            assert params.prompt_logprobs is not None
            out.prompt_logprobs[s.request_id] = chunk_prompt_logprobs(
                compute_logits, hidden[off : off + n], row.prompt_token_ids, s.start_pos, params.prompt_logprobs
            )
        if params.pooling is not None:
            vec = pool_chunk(row, s.start_pos, hidden[off : off + n])
            if vec is not None:
                out.pooled[s.request_id] = vec
        off += n
    return out
