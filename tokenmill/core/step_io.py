"""What crosses the scheduler/runner boundary: plain data, no live objects, picklable, so the runner can
live in another process (a tensor-parallel rank, a prefill or decode worker).

The runner keeps a row per request (worker/model_runner.py, `RequestState`): prompt, tokens so far,
sampling parameters, block table. The scheduler sends a request's prompt and parameters once, as
`NewRequestData`, and afterwards only what changed (`ScheduledChunk`):

    step 1   new   A: prompt [5, 9, 2], blocks [7]          chunk A: start 0, 3 tokens
    step 2         (A sampled 4 in step 1)                  chunk A: start 3, 1 token, new tokens [4]
    step 5         (A reached a new block)                  chunk A: ..., new blocks [3]
    step 9   A was preempted in step 8                      new A again: prompt + outputs, its new blocks

The runner never samples into its rows: a token it returned becomes part of the row when the scheduler
sends it back (`new_token_ids`), so what the engine keeps (stop conditions, rejected drafts, beams that
take a token back) is what the runner sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from tokenmill.outputs import Logprob
from tokenmill.sampling_params import SamplingParams


class BlockCopy(NamedTuple):
    """Copy-on-write: copy block src's K/V (every layer) into block dst before the step's forward."""

    src: int
    dst: int


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no row for: admitted, resumed after preemption, or forked."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated so far (a resumed request recomputes them; a fork of a prompt has none)."""
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    """The block table of KV-cache group 0 (of every layer, for a model with one group)."""
    group_block_ids: list[list[int]] = field(default_factory=list)
    """The tables of groups 1.. (models with sliding-window layers: core/kv_cache_manager.py)."""
    max_tokens: int = 1 << 30
    """Outputs the request may have in all (its own max_tokens, or what max_model_len leaves): the runner's
    proposer never drafts past it."""
    cache_salt: str | None = None
    """The request's tenant: an online suffix store (spec_decode/suffix.py) drafts from its own text only."""


@dataclass(slots=True)
class ScheduledChunk:
    """One request's part of a step: tokens [start_pos, start_pos + num_new_tokens) of its row plus drafts."""

    request_id: str
    start_pos: int
    num_new_tokens: int
    """Tokens computed this step: a prompt chunk, 1 for a decode, 1 + k with k drafts, 0 for a fork."""
    new_token_ids: list[int] = field(default_factory=list)
    """Tokens appended to the request since the runner last heard of it (the ones it sampled)."""
    new_block_ids: list[int] = field(default_factory=list)
    """Blocks appended to its table (group 0's) since then."""
    replace_block_ids: bool = False
    """new_block_ids and new_group_block_ids are the whole tables (they changed other than by appending:
    copy on write)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens to verify: the last len(spec_token_ids) of this step's tokens."""
    is_sampling: bool = False
    """This step reaches the request's last token, so its logits are sampled."""
    fork_of: str | None = None
    """Forks (n > 1): sample this request from the logits of the named request's last token this step."""
    spec_parents: list[int] | None = None
    """The drafts form a token tree: draft i's parent draft (-1: the request's last real token), parents
    first (spec_decode/tree.py). None: a chain."""
    new_group_block_ids: list[list[int]] = field(default_factory=list)
    """Groups 1.. : blocks appended to each table since then (empty lists for a one-group model: none)."""
    wants_prompt_logprobs: bool = False
    """Return the logprobs of the prompt tokens this chunk's logits predict (`PromptLogprobs`): the request asked
    (SamplingParams.prompt_logprobs) and still misses some. Only such chunks have logits at every position."""


@dataclass(frozen=True)
class StepInput:
    """Everything the runner needs for one step, in the order it applies it."""

    finished_ids: list[str] = field(default_factory=list)
    """Requests that left since the last step: rows and generators dropped."""
    preempted_ids: list[str] = field(default_factory=list)
    """Rows dropped (a resumed request comes back as new); generators kept, so seeded outputs hold."""
    new_requests: list[NewRequestData] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    scheduled: list[ScheduledChunk] = field(default_factory=list)
    forked: list[ScheduledChunk] = field(default_factory=list)
    token_masks: dict[str, bytes] = field(default_factory=dict)
    """Structured outputs: per request id under a grammar, its allowed-token bitmask rows (int32 words,
    tokenmill.structured.grammar's layout), one per logits row it samples: the next token, then after each
    draft's path. Requests without a grammar are absent."""

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.scheduled)


@dataclass(slots=True)
class StepTokens:
    """The runner's unit of work: one request's tokens in a forward pass, with its block table.
    Proposers that run a model through a ModelRunner (draft model, EAGLE) build these too."""

    request_id: str
    start_pos: int
    token_ids: list[int]
    block_ids: list[int]
    num_spec_tokens: int = 0
    is_sampling: bool = True
    fork_of: str | None = None
    spec_parents: list[int] | None = None
    """The last num_spec_tokens tokens are a token tree's nodes with these parents (ScheduledChunk), or None."""
    group_block_ids: list[list[int]] = field(default_factory=list)
    """The tables of KV-cache groups 1.. (block_ids is group 0's); empty for a one-group model."""

    def tables(self) -> list[list[int]]:
        """Every group's block table, group 0 first."""
        return [self.block_ids, *self.group_block_ids]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tree_parents(self) -> list[int] | None:
        """spec_parents when the drafts are a tree that is not a chain (it needs a tree mask), else None."""
        p = self.spec_parents
        if p is None or all(x == i - 1 for i, x in enumerate(p)):
            return None
        return p


@dataclass
class SamplerResult:
    """What the runner sampled for one request this step."""

    token_ids: list[int]
    """Accepted tokens in order (one without speculation; up to 1 + k with k drafts)."""
    logprobs: list | None = None
    """Per token: dict[token_id, Logprob] (sampled + top-N), if requested."""
    accepted_nodes: list[int] | None = None
    """A verified token tree: the accepted nodes, root to deepest (their K/V are then moved into consecutive
    slots by the runner). None for chains and plain sampling."""


@dataclass
class PromptLogprobs:
    """One prompt chunk's prompt logprobs: the logits at positions [p, q) of the chunk predict prompt tokens
    p + 1 .. q (those that are prompt tokens), each an entry {token id: Logprob} with the prompt's own token and
    the top-N (SamplingParams.prompt_logprobs) of the raw model distribution.

        prompt [t0 t1 t2 t3 t4], chunks [0, 3) and [3, 5):
        chunk 1 -> start_pos 1, entries for t1 t2 t3 (logits at 0, 1, 2)
        chunk 2 -> start_pos 4, entries for t4       (logits at 3; those at 4 sample the first output)
    """

    start_pos: int
    """The prompt position of the first entry."""
    entries: list[dict[int, Logprob]]


@dataclass(frozen=True)
class Drafts:
    """Draft tokens a runner proposes for a request's next step (speculative decoding, spec_decode/)."""

    token_ids: list[int]
    parents: list[int] | None = None
    """A token tree: draft i's parent draft (-1: the request's last token), parents first; None: a chain."""


@dataclass(frozen=True)
class PathMove:
    """A verified token tree's accepted path, moved into consecutive slots of one block table (every layer):
    node a_j's K/V, written at position base + a_j, goes to position base + j (worker/kv_cache_ops.py)."""

    block_ids: list[int]
    base: int
    accepted_nodes: list[int]


@dataclass
class StepOutput:
    """What a runner returns for one step (worker/executor.py's `Executor.execute`)."""

    results: dict[str, SamplerResult] = field(default_factory=dict)
    """request id -> what it sampled (requests that sampled this step)."""
    drafts: dict[str, Drafts] = field(default_factory=dict)
    """request id -> drafts for its next step, from the runner's proposer; the scheduler stores them on the
    request (unless it finished) and schedules them under the one rule."""
    spec_metrics: dict[str, float] | None = None
    """The runner's speculative-decoding counters so far (cumulative), or None without speculation."""
    path_moves: list[PathMove] = field(default_factory=list)
    """The K/V moves this step's tree verification made in the runner's cache: tensor-parallel ranks 1..,
    which do not verify, make the same moves in theirs (worker/tp_executor.py)."""
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    """request id -> its chunk's prompt logprobs (chunks with ScheduledChunk.wants_prompt_logprobs)."""
    pooled: dict[str, list[float]] = field(default_factory=dict)
    """request id -> its L2-normalised pooled final hidden states (SamplingParams.pooling), from the step that
    computed its last prompt token."""


@dataclass(slots=True)
class DraftRequest:
    """A runner row as a proposer sees it right after the row sampled: its tokens including the ones just
    sampled (the scheduler has not confirmed them yet), its target block table and sampling parameters.
    It is what the runner's sampling-metadata builder reads too (core/step_io.SamplingRow)."""

    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    """Prompt + outputs, the tokens this step sampled included."""
    block_ids: list[int]
    """The target's block table (KV-cache group 0), as the step that just ran used it."""
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int
    """Outputs the request may have in all."""
    cache_salt: str | None = None
    """Its tenant (NewRequestData.cache_salt)."""

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def has_stopped(self) -> bool:
        """Its last token ends it (EOS or a stop token past min_tokens, or max_tokens reached): no drafts.
        Stop strings are the engine's to find; drafts of a request that stops there are dropped unused."""
        p = self.sampling_params
        if self.num_output_tokens >= self.max_tokens:
            return True
        if self.num_output_tokens < p.min_tokens or not self.output_token_ids:
            return False
        last = self.all_token_ids[-1]
        return (last == self.eos_token_id and not p.ignore_eos) or last in p.stop_token_ids


class SamplingRow(Protocol):
    """What the runner's sampling-metadata builder reads of a request: its own row, or a proposer's
    request (a draft model samples with the target request's parameters)."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    eos_token_id: int | None

    @property
    def output_token_ids(self) -> Sequence[int]: ...

    @property
    def num_output_tokens(self) -> int: ...
