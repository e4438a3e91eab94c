"""Continuous batching under one rule (DESIGN.md).

Every step, each request's num_computed_tokens catches up toward num_tokens_with_spec under a
token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs):
  1. running requests first, oldest first (a decode costs 1 token, or 1 + k with k drafts);
  2. then waiting requests, whose prompt may be chunked and whose first blocks may be cached;
  3. if a running request cannot get a block, the newest running request is preempted (blocks
     freed, recomputed later) and nobody new is admitted in this step.
The scheduler never sees tensors; it hands the runner a SchedulerOutput.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.config import CacheConfig, KVCacheGroup, SchedulerConfig
from tokenmill.core.kv_cache_manager import ComputedBlocks, KVCacheManager
from tokenmill.core.step_cost import StepCostModel, chunk_kilo_keys
from tokenmill.core.step_io import BlockCopy, NewRequestData, ScheduledChunk, StepInput, StepOutput
from tokenmill.distributed.kv_connector import (
    ConnectorEvents,
    ConnectorStep,
    HoldForDecode,
    KVConnectorScheduler,
    KVLoad,
    PullFromPrefill,
)
from tokenmill.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    """Tokens computed this step: a prefill chunk, 1 for a decode, 1 + k with k drafts."""
    start_pos: int
    """num_computed_tokens before this step (position of the first new token)."""
    block_ids: list[int]
    num_spec_tokens: int = 0
    """Draft tokens among the last new tokens, to be verified this step."""
    fork_of: str | None = None
    """Set on `SchedulerOutput.forked` entries: sample this request (0 new tokens) from the
    logits of the named request's last token in this step."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_sampling(self) -> bool:
        """True if this step reaches the request's last token, so its logits are sampled (never for a prompt-only
        request: it finishes there)."""
        return (
            self.start_pos + self.num_new_tokens == self.request.num_tokens_with_spec
            and not self.request.is_prompt_only
        )

    @property
    def token_ids(self) -> list[int]:
        toks = self.request.all_token_ids + self.request.spec_token_ids
        return toks[self.start_pos : self.start_pos + self.num_new_tokens]


@dataclass(frozen=True)
class TokenSplit:
    """A step's token budget, split by what the tokens are for."""

    num_decode: int
    """Requests' last real tokens, one per stream that samples this step."""
    num_prefill: int
    """Prompt (or recomputed) tokens in chunks: a chunk that ends the prompt counts whole here."""
    num_draft: int
    """Speculative draft tokens verified this step."""


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    """Requests finished since the last step; the runner drops their per-request state."""
    forked: list[ScheduledRequest] = field(default_factory=list)
    """Samples 2..n of a prompt whose last token is computed this step by its leader (n > 1):
    they share the leader's blocks and sample from its logits, computing nothing."""
    block_copies: list[BlockCopy] = field(default_factory=list)
    """Copy-on-write: (src, dst) block pairs whose K/V (all layers) the runner copies, in order,
    before this step's forward."""
    step: StepInput = field(default_factory=StepInput)
    """The runner's view of this step: plain data, new rows once, deltas after (core/step_io.py)."""
    kv: ConnectorStep | None = None
    """Disaggregation: blocks to pull, hold or release (the KV connector's worker half applies it)."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def token_split(self) -> TokenSplit:
        """E.g. two decodes with 3 drafts each, a 40-token chunk mid-prompt and the last 7 of another prompt:
        TokenSplit(num_decode=2, num_prefill=47, num_draft=6)."""
        decode = prefill = draft = 0
        for s in self.scheduled:
            real = s.num_new_tokens - s.num_spec_tokens
            draft += s.num_spec_tokens
            if (
                real == 1 and s.start_pos >= s.request.num_prompt_tokens
            ):  # NOTE: constant fields only: valid after update()
                decode += 1
            else:
                prefill += real
        return TokenSplit(decode, prefill, draft)


@dataclass(frozen=True)
class PrefillAllowance:
    """What one step may spend on prompt chunks under the step-time target (Scheduler._prefill_allowance)."""

    tokens: int
    """Prompt tokens: the chunk of the first prompt in progress that fits beside the decodes, at least
    min_prefill_chunk."""
    room_s: float | None = None
    """Seconds of the target the decodes leave, by the step-time model (None before it is fitted). A plan spends
    them prompt by prompt, each priced from where it stands: a chunk late in a long prompt reads hundreds of keys
    per token, and sized as if it started where the first prompt stands it ran steps 40% over the target."""


@dataclass(frozen=True)
class PrefillPlan:
    """One step's share of the prompt allowance (Scheduler._prefill_plan)."""

    take: dict[str, int]
    """New tokens per prompt that computes this step (a chunk's last token included)."""
    admit: list[Request]
    """The waiting requests among them, in the order they are admitted."""


@dataclass
class _RunnerView:
    """What the runner was last sent of a request (its row there): its token and block counts."""

    num_tokens: int
    num_blocks: list[int]
    """Per KV-cache group."""


class Scheduler:
    def __init__(
        self,
        sched: SchedulerConfig,
        cache: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        connector: KVConnectorScheduler | None = None,
        kv_groups: Sequence[KVCacheGroup] | None = None,
    ) -> None:
        """connector: the KV connector's scheduler half (prefill/decode disaggregation), or None.
        kv_groups: the model's KV-cache groups (config.plan_kv_groups); None: one."""
        self.config = sched
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, kv_groups)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_since_step: list[str] = []
        self.num_preemptions = 0
        self.pending_forks: dict[str, list[Request]] = {}
        """Leader id -> samples that fork from it once its prompt is computed (n > 1)."""
        self.runner_views: dict[str, _RunnerView] = {}
        """Request id -> what the runner holds of it, so each step sends only what changed."""
        self.step_cost = StepCostModel()
        """Step time vs decode and prefill tokens, fitted from `observe_step` (sizes chunks under target_step_ms)."""
        self.connector = connector
        self.loading: dict[str, Request] = {}
        """Requests whose prompt K/V are being pulled from a prefill worker (WAITING_FOR_REMOTE_KV)."""

    # ------------------------------------------------------------------ intake
    def add_request(self, req: Request, forks: list[Request] | None = None) -> None:
        """Queue `req`. `forks` (samples 2..n of the same prompt) wait until req's prompt is
        computed, then share its blocks (see `_fork_pending`)."""
        self.waiting.append(req)
        self.requests[req.request_id] = req
        if forks:
            self.pending_forks[req.request_id] = list(forks)
            for f in forks:
                self.requests[f.request_id] = f

    def _num_reserved_seqs(self) -> int:
        """Sequence slots promised to pending forks of running leaders."""
        return sum(
            len(f) for lid, f in self.pending_forks.items() if self.requests[lid].status == RequestStatus.RUNNING
        )

    def _fork_pending(self, sr: ScheduledRequest, out: SchedulerOutput, new_running: list[Request]) -> None:
        """n > 1: from the step that computes the leader's last prompt token, the other samples
        hold the leader's blocks by reference and sample their first token from its logits, so
        the prompt is computed once. The shared partial last block is copied on first write."""
        forks = self.pending_forks.pop(sr.request_id, None)
        if not forks:
            return
        leader = sr.request
        assert sr.is_sampling and leader.num_output_tokens == 0
        for f in forks:
            f.num_computed_tokens = leader.num_tokens  # true once this step has run
            self.kv.fork(leader, f, leader.num_tokens)
            f.status = RequestStatus.RUNNING
            f.num_cached_tokens = leader.num_cached_tokens
            f.first_scheduled_time = leader.first_scheduled_time
            new_running.append(f)
            out.forked.append(
                ScheduledRequest(
                    f, 0, f.num_computed_tokens, self.kv.get_block_ids(f.request_id), fork_of=leader.request_id
                )
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # ------------------------------------------------------------- step time
    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine's measured time for a step it ran (the forward and sampling). Each request's last real
        token and its drafts count as decode tokens, the rest of a prompt chunk as prefill (core/step_cost.py).
        Without a step-time target nothing reads the model, so nothing is fitted (no work on the step path)."""
        if self.config.target_step_ms is None and self.config.step_time_factor is None:
            return
        num_prefill = sum(max(0, s.num_new_tokens - s.num_spec_tokens - 1) for s in out.scheduled)
        keys = sum(chunk_kilo_keys(s.start_pos, s.num_new_tokens) for s in out.scheduled)
        self.step_cost.observe(out.num_tokens - num_prefill, num_prefill, seconds, keys)

    def _prefill_allowance(self) -> PrefillAllowance | None:
        """What this step may spend on prompts under the step-time target (None: no limit but the budget).
        The target is target_step_ms, else step_time_factor x the predicted time of the decode step this one is
        heading to (_heading_decode_step)."""
        target, factor, cost = self.config.target_step_ms, self.config.step_time_factor, self.step_cost.cost
        if target is None and (factor is None or not self.config.enable_chunked_prefill):
            return None
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens <= 1]
        if target is None and not decodes:
            return None  # a relative target with nothing decoding: no stream waits on this step
        if cost is None:  # not measured yet: the smallest chunks, which are safe and teach the model quickly
            return PrefillAllowance(self.config.min_prefill_chunk)
        num_decodes = sum(1 + len(r.spec_token_ids) for r in decodes)
        decode_keys = sum(chunk_kilo_keys(r.num_computed_tokens, 1 + len(r.spec_token_ids)) for r in decodes)
        chunking = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        if target is None:
            assert factor is not None  # without a target and a factor this returned None above
            target = factor * self._heading_decode_step(num_decodes, decode_keys, chunking) * 1000.0
        # the next chunk starts where the first prompt in progress (running, else waiting) stands
        start = chunking[0].num_computed_tokens if chunking else 0
        room = cost.decode_room(num_decodes, target / 1000.0, decode_keys)
        return PrefillAllowance(max(self.config.min_prefill_chunk, cost.chunk_tokens(room, start)), room)

    def _heading_decode_step(self, num_decodes: int, decode_keys: float, chunking: list[Request]) -> float:
        """Predicted seconds of a decode-only step for the batch this one is heading to: today's decodes (their
        tokens and kilo-keys, as _prefill_allowance counted them) plus the prompts in progress and waiting (up
        to max_num_seqs), each of those reading its prompt's keys.

        Why not today's decodes alone: under load the prompts that wait are the streams of the next steps, and
        a target tied to the few that decode now throttles the prefill that would make them decode (a closed
        loop settles with a third of the streams queued; docs/architecture.md). Example: 4 decodes, 1 prompt
        chunking, 27 waiting, max_num_seqs 64: the target is factor x the predicted step of 32 decodes."""
        cost = self.step_cost.cost
        assert cost is not None
        room = max(0, self.config.max_num_seqs - len(self.running) - len(self.loading))
        coming = chunking + list(itertools.islice(self.waiting, room))
        keys = decode_keys + sum(chunk_kilo_keys(r.num_tokens, 1) for r in coming)
        return cost.predict(num_decodes + len(coming), 0, keys)

    # ----------------------------------------------------------- KV transfer
    def apply_kv_events(self, events: ConnectorEvents) -> None:
        """Loads that ended become running requests: with the pulled K/V counted as computed (all but the last
        prompt token), or, when the pull failed, with only their local prefix hit (the rest is recomputed here).
        Served transfers release their held blocks."""
        assert self.connector is not None, "KV events come from the connector's worker half"
        for rid, ok in events.loads_done.items():
            req = self.loading.pop(rid, None)
            if req is None:
                continue  # left while loading
            if ok:
                req.num_computed_tokens = req.num_tokens - 1
                self.kv.cache_blocks(req, req.num_computed_tokens)
            else:
                self.connector.stats.num_loads_failed += 1
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        for tid in events.sends_done:
            if tid in self.connector.held:
                self.kv.release_held(tid)
                self.connector.release(tid)

    def _release_expired_holds(self) -> None:
        assert self.connector is not None
        for tid in self.connector.expired():
            self.kv.release_held(tid)
            self.connector.release(tid, expired=True)

    def _admit_remote(self, req: Request, source: PullFromPrefill) -> bool:
        """Admit a request whose prompt K/V a prefill worker holds: blocks for its whole prompt (after the local
        prefix hit), the pull queued, no token budget spent. False if the pool cannot supply the blocks."""
        assert self.connector is not None, "the engine accepts pulls from a prefill worker only with a connector"
        computed = self.kv.get_computed_blocks(req, tails=False)  # pulls come in whole blocks
        plan = self.connector.plan_load(source, req.num_tokens, computed.num_tokens, self.block_size)
        if plan.num_blocks == 0:  # everything but the last token is cached here: an ordinary admission
            req.kv_transfer = None
            return False
        if self.kv.allocate_slots(req, req.num_tokens - computed.num_tokens, computed, cache_blocks=False) is None:
            return False
        self.waiting.popleft()
        req.kv_transfer = None
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        req.num_cached_tokens = req.num_computed_tokens = computed.num_tokens
        self.loading[req.request_id] = req
        blocks = self.kv.get_block_ids(req.request_id)
        self.connector.add_load(
            KVLoad(
                req.request_id, source, plan.first_block, blocks[plan.first_block : plan.first_block + plan.num_blocks]
            ),
            num_skipped_blocks=plan.first_block,
        )
        return True

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        assert status.is_finished
        for f in self.pending_forks.pop(request_id, []):  # orphaned samples go on alone
            self.waiting.append(f)
        for forks in self.pending_forks.values():
            if req in forks:
                forks.remove(req)
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.loading[request_id]
            assert self.connector is not None  # only a connector's pulls load
            self.connector.cancel_load(request_id)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = status
        req.clear_drafts()
        req.finished_time = time.time()
        self.kv.free(req)
        self.kv.forget(request_id)
        self.finished_since_step.append(request_id)
        return req

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(finished_ids=self.finished_since_step)
        self.finished_since_step = []
        now = time.time()
        new_forks: list[Request] = []
        if self.connector is not None:
            self._release_expired_holds()

        allowance = self._prefill_allowance()
        prefill_left = None if allowance is None else allowance.tokens
        plan = None if allowance is None else self._prefill_plan(allowance)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.spec_token_ids:  # drafts are verified all at once: drop those the budget cannot hold
                req.truncate_drafts(max(0, budget - (req.num_tokens - req.num_computed_tokens)))
            num_new = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            if prefill_left is not None and not req.spec_token_ids and num_new > 1:  # a prompt chunk
                if plan is not None:
                    if req.request_id not in plan.take:
                        i += 1
                        continue  # shorter prompts take this step's allowance
                    num_new = min(num_new, plan.take[req.request_id])
                else:
                    num_new = min(num_new, 1 + prefill_left)
                    prefill_left -= num_new - 1
            while True:
                if self.kv.allocate_slots(req, num_new) is not None:
                    break
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            num_spec = max(0, req.num_computed_tokens + num_new - req.num_tokens)
            out.scheduled.append(
                ScheduledRequest(req, num_new, req.num_computed_tokens, self.kv.get_block_ids(req.request_id), num_spec)
            )
            if req.request_id in self.pending_forks and out.scheduled[-1].is_sampling:
                self._fork_pending(out.scheduled[-1], out, new_forks)
            budget -= num_new
            i += 1
        self.running.extend(new_forks)  # after the loop: never preempted in the step that forks them

        if not out.preempted_ids and plan is not None:
            budget = self._admit_planned(plan, budget, out, now)
        elif not out.preempted_ids:
            while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
                req = self.waiting[0]
                if isinstance(req.kv_transfer, PullFromPrefill):
                    if req.first_scheduled_time is None:
                        req.first_scheduled_time = now
                    if self._admit_remote(req, req.kv_transfer):
                        continue
                    if req.kv_transfer is not None:
                        break  # no blocks for it yet
                if (
                    self.pending_forks
                    and len(self.running)
                    + self._num_reserved_seqs()
                    + 1
                    + len(self.pending_forks.get(req.request_id, ()))
                    > self.config.max_num_seqs
                ):
                    break  # pending samples (n > 1) will need sequence slots too
                computed = self._computed_blocks(req)
                num_new = req.num_tokens - computed.num_tokens
                if num_new > budget and not self.config.enable_chunked_prefill:
                    break
                num_new = min(num_new, budget)
                if prefill_left is not None and num_new > 1:
                    if prefill_left == 0:
                        break  # this step's prompt allowance is spent; it waits for the next step
                    num_new = min(num_new, 1 + prefill_left)
                    prefill_left -= num_new - 1
                if not self._admit(req, num_new, computed, out, now):
                    break
                if req.request_id in self.pending_forks and out.scheduled[-1].is_sampling:
                    new_forks = []
                    self._fork_pending(out.scheduled[-1], out, new_forks)
                    self.running.extend(new_forks)
                budget -= num_new
        out.block_copies = self.kv.take_block_copies()
        out.step = self._runner_step(out)
        if self.connector is not None:
            out.kv = self.connector.take_step()
        return out

    def _prefill_plan(self, allowance: PrefillAllowance) -> PrefillPlan | None:
        """How this step's prompt allowance is shared: the oldest prompt (the first chunking, else the first
        waiting) is promised min_prefill_chunk tokens, so nothing starves; the rest goes to the prompts with
        the fewest tokens left first, which is what lowers the median time to first token when one long prompt
        would hold everyone behind it; what is left after them goes back to the oldest. Each chunk also has to
        fit in the seconds the decodes leave (allowance.room_s), priced from its own prompt's position: 54 tokens
        at position 905 cost as much as ~120 at 0. None (first come, first served) when a waiting request is
        special: a pull from a prefill worker, or samples of n > 1.

        Example: allowance 100, min_prefill_chunk 16; chunking A has 900 tokens left, waiting B 40 and C 30
        (queued in that order). A is promised 16, C takes 30 (29 of the allowance: its last token is a
        decode's), B 40 (39), A the 16 left over: A 1 + 32 tokens, C 30, B 40."""
        if self.pending_forks or any(r.kv_transfer is not None for r in self.waiting):
            return None
        free_seqs = max(0, self.config.max_num_seqs - len(self.running) - len(self.loading))
        chunking = [r for r in self.running if not r.spec_token_ids and r.num_tokens - r.num_computed_tokens > 1]
        prompts = chunking + list(itertools.islice(self.waiting, free_seqs))
        if not prompts:
            return PrefillPlan({}, [])
        left = {r.request_id: r.num_tokens - r.num_computed_tokens for r in prompts}
        tokens, room, cost = allowance.tokens, allowance.room_s, self.step_cost.cost

        def fit(start: int, n: int) -> int:
            """At most n tokens from position start: those the room left holds (1e-9 s: rounding)."""
            nonlocal room
            if room is not None and cost is not None and n > 0:
                n = min(n, cost.chunk_tokens(room + 1e-9, start))
                room -= cost.chunk_cost(start, n)
            return n

        oldest = prompts[0]
        promised = min(left[oldest.request_id] - 1, self.config.min_prefill_chunk, tokens)
        tokens -= promised
        if room is not None and cost is not None:  # the promise holds whatever the room: nothing starves
            room -= cost.chunk_cost(oldest.num_computed_tokens, promised)
        take: dict[str, int] = {}
        for r in sorted(prompts[1:], key=lambda r: left[r.request_id]):  # stable: ties stay in queue order
            need = left[r.request_id] - 1  # prefill tokens; the chunk's last token is sampled like a decode
            got = fit(r.num_computed_tokens, min(need, tokens))
            if need > 0 and got == 0:
                break
            take[r.request_id] = 1 + got
            tokens -= got
        rest = fit(oldest.num_computed_tokens + promised, min(left[oldest.request_id] - 1 - promised, tokens))
        take[oldest.request_id] = 1 + promised + rest
        admit = [r for r in prompts[len(chunking) :] if r.request_id in take]
        admit.sort(key=lambda r: (r is not oldest, left[r.request_id]))  # the oldest first, then shortest first
        return PrefillPlan(take, admit)

    def _admit_planned(self, plan: PrefillPlan, budget: int, out: SchedulerOutput, now: float) -> int:
        """Admit the waiting prompts the plan gives tokens to, in its order (not necessarily the queue's), each
        with its planned chunk; stop at the first the budget or the block pool cannot hold. Returns the budget
        left."""
        for req in plan.admit:
            if budget <= 0:
                break
            computed = self._computed_blocks(req)
            num_new = min(req.num_tokens - computed.num_tokens, budget, plan.take[req.request_id])
            if not self._admit(req, num_new, computed, out, now):
                break
            budget -= num_new
        return budget

    def _computed_blocks(self, req: Request) -> ComputedBlocks:
        """The prefix-cache hit a waiting request is admitted with. None for a request that reads every prompt
        position (prompt logprobs still missing, mean pooling: `Request.computes_whole_prompt`): a hit would skip
        positions, so it recomputes its whole prompt (counted as a miss in the prefix-cache stats)."""
        if req.computes_whole_prompt:
            return ComputedBlocks([], 0, [[] for _ in self.kv.groups[1:]])
        return self.kv.get_computed_blocks(req)

    def _admit(self, req: Request, num_new: int, computed: ComputedBlocks, out: SchedulerOutput, now: float) -> bool:
        """Move a waiting request to running with num_new tokens scheduled after its prefix hit; False (and
        nothing changed) if the pool cannot supply the blocks."""
        if self.kv.allocate_slots(req, num_new, computed) is None:
            return False
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        if req.num_preemptions == 0:
            req.num_cached_tokens = computed.num_tokens
        req.num_computed_tokens = computed.num_tokens
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        self.running.append(req)
        out.scheduled.append(
            ScheduledRequest(req, num_new, req.num_computed_tokens, self.kv.get_block_ids(req.request_id))
        )
        return True

    def _runner_step(self, out: SchedulerOutput) -> StepInput:
        """This step as the runner sees it: a request it holds no row for is sent whole (admitted,
        resumed, forked, or rewound by beam search), the others as deltas of tokens and blocks."""
        views = self.runner_views
        for rid in out.finished_ids:
            views.pop(rid, None)
        for rid in out.preempted_ids:
            views.pop(rid, None)
        new: list[NewRequestData] = []
        rewritten = self.kv.take_rewritten()

        def chunk(s: ScheduledRequest) -> ScheduledChunk:
            req = s.request
            rid = req.request_id
            tables = [s.block_ids, *self.kv.get_group_block_ids(rid, first_group=1)]  # (group 0's: at schedule time)
            view = views.get(rid)
            new_tokens: list[int] = []
            new_tables: list[list[int]] = [[] for _ in tables]
            replace = False
            if view is None or req.num_tokens < view.num_tokens:  # (beam search takes tokens back: a new row)
                new.append(
                    NewRequestData(
                        rid,
                        list(req.prompt_token_ids),
                        list(req.output_token_ids),
                        req.sampling_params,
                        req.eos_token_id,
                        list(tables[0]),
                        tables[1:],
                        req.max_tokens,
                        req.cache_salt,
                    )
                )
                views[rid] = _RunnerView(req.num_tokens, [len(t) for t in tables])
            else:
                new_tokens = req.all_token_ids[view.num_tokens :]
                replace = rid in rewritten  # copy on write replaced a block: the whole tables; else appends
                new_tables = [list(t) if replace else t[n:] for t, n in zip(tables, view.num_blocks)]
                view.num_tokens, view.num_blocks = req.num_tokens, [len(t) for t in tables]
            return ScheduledChunk(
                rid,
                s.start_pos,
                s.num_new_tokens,
                new_tokens,
                new_tables[0],
                replace,
                req.spec_token_ids[: s.num_spec_tokens],
                s.is_sampling,
                s.fork_of,
                None if req.spec_parents is None else req.spec_parents[: s.num_spec_tokens],
                new_tables[1:],
                req.needs_prompt_logprobs and s.num_new_tokens > 0 and s.start_pos < req.num_prompt_tokens - 1,
            )

        scheduled = [chunk(s) for s in out.scheduled]
        forked = [chunk(s) for s in out.forked]
        return StepInput(
            list(out.finished_ids), list(out.preempted_ids), new, list(out.block_copies), scheduled, forked
        )

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.clear_drafts()
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ update
    def update(self, sched: SchedulerOutput, output: StepOutput) -> list[Request]:
        """Advance progress counters, append accepted tokens, roll back rejected drafts, apply
        token-level stop conditions, store the runner's drafts for the next step on requests that go on.
        Returns requests that received new tokens."""
        changed: list[Request] = []
        now = time.time()
        results = output.results
        for s in sched.scheduled + sched.forked:
            req = s.request
            if req.is_finished:
                continue
            req.num_computed_tokens += s.num_new_tokens
            chunk_logprobs = output.prompt_logprobs.get(req.request_id)
            if chunk_logprobs is not None:
                req.add_prompt_logprobs(chunk_logprobs.start_pos, chunk_logprobs.entries)
            if req.is_prompt_only:  # no sampling: it ends once its prompt is computed
                if req.num_computed_tokens >= req.num_tokens:
                    req.embedding = output.pooled.get(req.request_id)
                    req.status = RequestStatus.FINISHED_LENGTH
                    req.first_token_time = req.last_token_time = now
                    changed.append(req)
                    self._retire(req, now)
                continue
            res = results.get(req.request_id)
            if res is None:
                continue
            # Drafts: num_computed counted them all; keep only the accepted ones (their K/V are
            # right). The last accepted token's K/V is not in the cache yet.
            num_drafts = len(req.spec_token_ids)
            if num_drafts:
                num_accepted = len(res.token_ids) - 1
                req.num_computed_tokens -= num_drafts - num_accepted
                req.clear_drafts()
            for j, tok in enumerate(res.token_ids):
                req.append_output_token(tok)
                if res.logprobs is not None:
                    req.logprobs.append(res.logprobs[j])
                if self._check_stop(req, tok):
                    # Tokens after a stop are discarded; their K/V beyond num_tokens is garbage.
                    req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                    break
            drafts = output.drafts.get(req.request_id)
            if drafts is not None and not req.is_finished:  # its next step is a decode: 1 + k tokens
                req.set_drafts(drafts.token_ids, drafts.parents)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            changed.append(req)
            if req.is_finished:
                self._retire(req, now)
        return changed

    def _retire(self, req: Request, now: float) -> None:
        """A running request that finished in update(): out of the running list, its blocks freed (or held for a
        decode worker), its row dropped by the runner at the next step."""
        self.requests.pop(req.request_id, None)
        self.running.remove(req)
        req.finished_time = now
        if isinstance(req.kv_transfer, HoldForDecode):  # a prefill worker's request: keep its K/V
            assert self.connector is not None, "only a connector's engine accepts HoldForDecode"
            self.connector.add_hold(req.request_id, self.kv.hold(req, req.request_id))
        else:
            self.kv.free(req)
        self.kv.forget(req.request_id)
        self.finished_since_step.append(req.request_id)

    def _check_stop(self, req: Request, tok: int) -> bool:
        p = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok == req.eos_token_id:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if tok in p.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = tok
                return True
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    # ------------------------------------------------------------- accounting
    def check_integrity(self) -> None:
        self.kv.check_integrity()
        live = (
            {r.request_id for r in self.running}
            | {r.request_id for r in self.waiting}
            | {f.request_id for forks in self.pending_forks.values() for f in forks}
            | set(self.loading)
        )
        assert set(self.kv.req_blocks) <= {r.request_id for r in self.running} | set(self.loading), (
            "blocks held by a non-running request"
        )
        if self.connector is not None:
            assert set(self.kv.held) == set(self.connector.held), "held transfers drift"
        assert live == set(self.requests), "request table drift"
