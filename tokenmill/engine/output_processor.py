"""From scheduler requests to what callers read: detokenizing, stop strings, logprobs, deltas, RequestOutputs.

A request asking for n samples is a parent with n children ("<id>#<i>"); the processor keeps the parents, each
child's incremental detokenizer and what its delta outputs have carried so far. After each step the engine core
hands it the requests that got tokens; it detokenizes them, ends those that hit a stop string (through the
scheduler, as any finish), and builds one output per touched parent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.request import Request, RequestStatus

if TYPE_CHECKING:
    from tokenmill.core.scheduler import Scheduler
    from tokenmill.tokenizer import Tokenizer


@dataclass
class Emitted:
    """What one sample's outputs have carried so far (for delta outputs)."""

    num_tokens: int = 0
    num_chars: int = 0
    cumulative_logprob: float = 0.0
    finished: bool = False
    has_prompt_logprobs: bool = False
    """The request's prompt logprobs went out (a delta output carries them once)."""


@dataclass
class ParentRequest:
    """A request as the caller made it: its n samples (children) and their detokenizers."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer]
    arrival_time: float
    emitted: list[Emitted] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.parents: dict[str, ParentRequest] = {}
        self.child_to_parent: dict[str, str] = {}
        self.num_generation_tokens = 0

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for child in parent.children:
            self.child_to_parent[child.request_id] = parent.request_id

    def knows(self, request_id: str) -> bool:
        return request_id in self.parents

    def abort(self, request_id: str) -> None:
        """Drop a parent; its unfinished samples are finished as aborted (their blocks freed)."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return
        for req in parent.children:
            self.child_to_parent.pop(req.request_id, None)
            if not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def process(
        self,
        changed: list[Request],
        held_kv: Callable[[Request], dict | None] | None = None,
    ) -> list[RequestOutput]:
        """Detokenize the step's new tokens, apply stop strings, build the outputs of the touched parents.
        held_kv: for a finished request, where a decode worker pulls its held K/V from (disaggregation), or None."""
        touched: dict[str, None] = {}
        for req in changed:
            pid = self.child_to_parent.get(req.request_id)
            if pid is None:
                raise AssertionError(f"step changed {req.request_id!r}, which the engine does not know")
            parent = self.parents[pid]
            detok = parent.detoks[req.sample_index]
            new = req.output_token_ids[detok.num_decoded :]
            self.num_generation_tokens += len(new)
            if (
                req.status == RequestStatus.FINISHED_STOPPED
                and new
                and (new[-1] == req.eos_token_id or new[-1] in req.sampling_params.stop_token_ids)
            ):
                new = new[:-1]  # a stop token ends the text without appearing in it
            stop = detok.update(new)
            if stop is not None and not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                req.stop_reason = stop
            elif stop is not None:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            touched[pid] = None
        outputs = []
        for pid in touched:
            parent = self.parents[pid]
            finished = all(r.is_finished for r in parent.children)
            kind = parent.children[0].sampling_params.output_kind
            if kind == "final" and not finished:
                continue
            held = held_kv(parent.children[0]) if finished and held_kv is not None else None
            out = self._delta(parent, finished, held) if kind == "delta" else self._cumulative(parent, finished, held)
            outputs.append(out)
            if finished:
                del self.parents[pid]
                for req in parent.children:
                    self.child_to_parent.pop(req.request_id, None)
        return outputs

    # ---------------------------------------------------------------- outputs
    def _decoded_logprobs(self, lps: list) -> list:
        assert self.tokenizer is not None  # requests are detokenized (their IncrementalDetokenizer) with it too
        for d in lps:
            if d is None:  # the first prompt token's entry
                continue
            for tok, lp in d.items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.tokenizer.decode([tok], skip_special_tokens=False)
        return lps

    @staticmethod
    def _metrics(parent: ParentRequest, finished: bool) -> RequestMetrics:
        first = [r.first_token_time for r in parent.children if r.first_token_time]
        sched = [r.first_scheduled_time for r in parent.children if r.first_scheduled_time]
        last = [r.last_token_time for r in parent.children if r.last_token_time]
        return RequestMetrics(
            arrival_time=parent.arrival_time,
            first_scheduled_time=min(sched, default=None),
            first_token_time=min(first, default=None),
            last_token_time=max(last, default=None),
            finished_time=time.time() if finished else None,
            num_generation_tokens=max(r.num_output_tokens for r in parent.children),
        )

    def _prompt_logprobs(self, parent: ParentRequest) -> list | None:
        """The request's prompt logprobs (its first sample computed them), decoded, once all positions are in."""
        first = parent.children[0]
        if first.prompt_logprobs is None or first.needs_prompt_logprobs:
            return None
        return self._decoded_logprobs(first.prompt_logprobs)

    def _cumulative(self, parent: ParentRequest, finished: bool, held: dict | None) -> RequestOutput:
        """Everything so far (output_kind "cumulative" or "final")."""
        comps = []
        for req, detok in zip(parent.children, parent.detoks):
            lps = None
            if req.sampling_params.logprobs is not None:
                lps = self._decoded_logprobs(req.logprobs[: len(req.output_token_ids)])
            comps.append(
                CompletionOutput(
                    index=req.sample_index,
                    text=detok.visible_text(req.is_finished),
                    token_ids=list(req.output_token_ids),
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                    logprobs=lps,
                    cumulative_logprob=sum(d[t].logprob for d, t in zip(lps, req.output_token_ids)) if lps else None,
                )
            )
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            comps,
            finished,
            self._metrics(parent, finished),
            num_cached_tokens=parent.children[0].num_cached_tokens,
            prompt_logprobs=self._prompt_logprobs(parent),
            kv_transfer_params=held,
            embedding=parent.children[0].embedding,
        )

    def _delta(self, parent: ParentRequest, finished: bool, held: dict | None) -> RequestOutput:
        """Only what is new since the last output (output_kind "delta"): work in proportion to the new
        tokens and text, not to the length so far."""
        comps = []
        for req, detok, sent in zip(parent.children, parent.detoks, parent.emitted):
            n = req.num_output_tokens
            new_ids = req.output_token_ids[sent.num_tokens : n]
            visible = detok.visible_len(req.is_finished)
            text = detok.text[sent.num_chars : visible] if visible > sent.num_chars else ""
            if not new_ids and not text and (sent.finished or not req.is_finished):
                continue
            lps = None
            cum = None
            if req.sampling_params.logprobs is not None:
                lps = self._decoded_logprobs(req.logprobs[sent.num_tokens : n])
                sent.cumulative_logprob += sum(d[t].logprob for d, t in zip(lps, new_ids))
                cum = sent.cumulative_logprob
            sent.num_tokens, sent.num_chars, sent.finished = n, max(visible, sent.num_chars), req.is_finished
            comps.append(
                CompletionOutput(
                    req.sample_index, text, list(new_ids), req.status.finish_reason, req.stop_reason, lps, cum, n
                )
            )
        prompt_logprobs = None
        if not parent.emitted[0].has_prompt_logprobs:
            prompt_logprobs = self._prompt_logprobs(parent)
            parent.emitted[0].has_prompt_logprobs = prompt_logprobs is not None
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            comps,
            finished,
            self._metrics(parent, finished),
            num_cached_tokens=parent.children[0].num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            is_delta=True,
            kv_transfer_params=held,
            embedding=parent.children[0].embedding,
        )
