"""Result dataclasses passed between layers and returned to users."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token, with its rank (1 = most likely) and decoded text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob, holding the sampled token plus the top-N.
SampleLogprobs = list[dict[int, Logprob]]

# One entry per prompt token: None for the first, then token id -> Logprob holding the prompt's token plus the top-N.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """'stop' (EOS, stop string or stop token), 'length' (max_tokens / max length), 'abort', or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the sample, if any."""
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    num_tokens: int = -1
    """Tokens generated so far in all (a delta's token_ids hold only the new ones); -1: len(token_ids)."""

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            self.num_tokens = len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merged(self, later: CompletionOutput) -> CompletionOutput:
        """This delta followed by `later`: texts, tokens and logprobs joined, the rest from `later`."""
        lps = None
        if self.logprobs is not None or later.logprobs is not None:
            lps = (self.logprobs or []) + (later.logprobs or [])
        return CompletionOutput(
            later.index,
            self.text + later.text,
            self.token_ids + later.token_ids,
            later.finish_reason,
            later.stop_reason,
            lps,
            later.cumulative_logprob,
            later.num_tokens,
        )


@dataclass
class RequestMetrics:
    """Timing of a request, in seconds since the epoch (time.time())."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean gap between output tokens after the first (vLLM's TPOT)."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduled: waiting for the step in flight, then for room in a step."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """First scheduled to first token: the steps that computed the prompt (several when it was chunked)."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """First token to last token."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time


@dataclass
class RequestOutput:
    """What the engine reports for a request: its prompt and one CompletionOutput per sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    prompt_logprobs: PromptLogprobs | None = field(default=None)
    """SamplingParams.prompt_logprobs: per prompt position (None for the first), once the whole prompt is computed;
    a delta output carries them once."""
    is_delta: bool = False
    """outputs hold only what is new since the previous output (SamplingParams.output_kind "delta")."""
    kv_transfer_params: dict | None = None
    """A prefill worker's finished request: where its prompt K/V wait for a decode worker (the fields of
    distributed/kv_connector.PullFromPrefill), passed on to the decode worker's request."""
    embedding: list[float] | None = None
    """A pooling request's (SamplingParams.pooling) L2-normalised embedding, once finished."""

    def merged(self, later: RequestOutput) -> RequestOutput:
        """Two consecutive outputs as one (a reader that lagged): deltas are joined choice by choice,
        nothing lost and nothing repeated; a cumulative output simply supersedes."""
        if not (self.is_delta and later.is_delta):
            return later
        mine = {c.index: c for c in self.outputs}
        outs = [mine.pop(c.index).merged(c) if c.index in mine else c for c in later.outputs]
        outs.extend(mine.values())  # choices with nothing new in `later`
        outs.sort(key=lambda c: c.index)
        return RequestOutput(
            later.request_id,
            later.prompt,
            later.prompt_token_ids,
            outs,
            later.finished,
            later.metrics,
            later.num_cached_tokens,
            later.prompt_logprobs if later.prompt_logprobs is not None else self.prompt_logprobs,
            True,
            later.kv_transfer_params,
            later.embedding if later.embedding is not None else self.embedding,
        )


@dataclass
class EmbeddingOutput:
    """vLLM's name: one prompt's embedding."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's shape)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


def truncate_embedding(embedding: list[float], dimensions: int) -> list[float]:
    """Matryoshka-style: the first `dimensions` values, L2-normalised again (plain Python: the server's threads
    stay free of torch). E.g. [0.6, 0.8, 0.0] to 1 -> [1.0]."""
    head = embedding[:dimensions]
    norm = math.sqrt(math.fsum(x * x for x in head))
    return [x / norm for x in head] if norm > 0 else head
