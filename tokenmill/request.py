"""A request as the scheduler sees it: token lists and one progress counter.

all_token_ids = prompt_token_ids + output_token_ids (+ spec_token_ids while scheduled)
num_computed_tokens: tokens whose K/V are in the cache; the scheduler lets it catch up to
num_tokens_with_spec, a chunk at a time.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, NewType

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.distributed.kv_connector import KVTransferRequest
    from tokenmill.outputs import Logprob

RequestId = NewType("RequestId", str)


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    """Blocks allocated; its prompt's K/V are being pulled from a prefill worker (distributed/kv_connector.py)."""
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        max_tokens: int,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        sample_index: int = 0,
        parent_id: str | None = None,
        kv_transfer: KVTransferRequest | None = None,
    ) -> None:
        self.request_id = RequestId(request_id)
        self.parent_id = parent_id or request_id
        self.sample_index = sample_index
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.spec_token_ids: list[int] = []
        """Draft tokens proposed for the next step (not yet verified), a token tree's nodes in listing order."""
        self.spec_parents: list[int] | None = None
        """Draft node i's parent (-1: the request's last token; spec_decode/tree.py), or None for a chain."""
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.kv_transfer = kv_transfer
        """Disaggregation: hold this prompt's K/V for a decode worker, or pull it from a prefill worker (consumed
        at admission: a preempted request recomputes locally)."""
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache when first scheduled."""
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.logprobs: list = []
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )
        """Per prompt position so far (the first has none: None), while sampling_params.prompt_logprobs asks."""
        self.embedding: list[float] | None = None
        """A pooling request's L2-normalised embedding, once its prompt is computed."""
        # timing
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

    def set_drafts(self, token_ids: list[int], parents: list[int] | None = None) -> None:
        """Drafts for the next step: a chain, or a token tree's nodes (parents first) when parents is given."""
        if parents is not None and len(parents) != len(token_ids):
            raise ValueError("a draft tree needs one parent per node")
        self.spec_token_ids = list(token_ids)
        self.spec_parents = None if parents is None else list(parents)

    def truncate_drafts(self, num: int) -> None:
        """Keep the first `num` drafts (a tree's first nodes are a tree: parents are listed first)."""
        del self.spec_token_ids[num:]
        if self.spec_parents is not None:
            del self.spec_parents[num:]

    def clear_drafts(self) -> None:
        self.spec_token_ids = []
        self.spec_parents = None

    @property
    def is_prompt_only(self) -> bool:
        """It finishes once its prompt is computed, without sampling (max_tokens 0: prompt logprobs, pooling)."""
        return self.max_tokens == 0

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some positions are still missing."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def computes_whole_prompt(self) -> bool:
        """Its prompt must be computed from position 0, without a prefix-cache hit: every position's logits
        (prompt logprobs still missing) or hidden state (mean pooling) is read."""
        return self.needs_prompt_logprobs or self.sampling_params.pooling == "mean"

    def add_prompt_logprobs(self, start_pos: int, entries: list[dict[int, Logprob]]) -> None:
        """A chunk's prompt logprobs, for positions start_pos, start_pos + 1, ...; positions already held (a chunk
        computed again after preemption) are skipped."""
        held = self.prompt_logprobs
        assert held is not None and start_pos <= len(held), "prompt logprobs arrive in position order"
        held.extend(entries[len(held) - start_pos :])

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.name})"
        )
