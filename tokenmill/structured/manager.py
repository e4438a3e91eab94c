"""The engine's side of structured outputs: one GrammarMatcher per sample, masks per step, tokens consumed.

Per step (EngineCore.step):

    sched = scheduler.schedule()
    masks = manager.step_masks(sched)        rows for every sampling request under a grammar:
                                             row 0 the next token, row 1 + i after draft i's path
    runner.execute(sched.step + masks)       the sampler / verifier bans what the rows ban
    scheduler.update(sched, results)
    manager.consume(changed)                 each matcher takes the tokens its request kept; a grammar that
                                             is complete ends its request (finish_reason "stop")

Drafts are walked, not consumed: try_consume(path) then rollback, so a rejected draft leaves no trace. A
draft the grammar bans gets a row too (all allowed; never used: the token before it is banned at its
parent's row, so the verifier rejects it there).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.sampling_params import StructuredOutputs
from tokenmill.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarMatcher

if TYPE_CHECKING:
    from tokenmill.core.scheduler import SchedulerOutput
    from tokenmill.request import Request
    from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill.structured")


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._compiler: GrammarCompiler | None = None
        self.matchers: dict[str, GrammarMatcher] = {}
        self.num_masks = 0
        """Bitmask rows computed (one per sampled position of a constrained request, drafts included)."""
        self.num_rejected_tokens = 0
        """Tokens a request kept that its grammar did not allow: always 0 unless a mask was not applied."""

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:  # NOTE: built on first use: ~0.5 s for a 49k vocabulary
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos)
        return self._compiler

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Validate before any state changes (InvalidRequest names the problem)."""
        return self.compiler.compile(spec)

    def add(self, request_ids: Iterable[str], compiled: CompiledGrammar) -> None:
        for rid in request_ids:
            self.matchers[rid] = self.compiler.matcher(compiled)

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.matchers.pop(rid, None)

    def constrain(self, sched: SchedulerOutput) -> SchedulerOutput:
        """The step with its allowed-token masks (StepInput.token_masks); matchers of finished requests dropped."""
        self.forget(sched.finished_ids)
        masks = self.step_masks(sched)
        if masks:
            sched.step = dataclasses.replace(sched.step, token_masks=masks)
        return sched

    def step_masks(self, sched: SchedulerOutput) -> dict[str, bytes]:
        if not self.matchers:
            return {}
        out: dict[str, bytes] = {}
        for s in [*sched.scheduled, *sched.forked]:
            m = self.matchers.get(s.request_id)
            if m is None or not (s.is_sampling or s.fork_of is not None):
                continue
            self._catch_up(s.request, m)
            k = s.num_spec_tokens
            drafts = s.request.spec_token_ids[:k]
            parents = s.request.spec_parents[:k] if s.request.spec_parents is not None else list(range(-1, k - 1))
            rows = np.empty((1 + k, m.num_words), dtype=np.int32)
            m.fill_bitmask(rows[0])
            paths: list[list[int]] = []
            for i, tok in enumerate(drafts):
                path = (paths[parents[i]] if parents[i] >= 0 else []) + [tok]
                paths.append(path)
                taken = m.try_consume(path)
                if taken == len(path):
                    m.fill_bitmask(rows[1 + i])
                else:
                    rows[1 + i] = -1
                m.rollback(taken)
            self.num_masks += 1 + k
            out[s.request_id] = rows.tobytes()
        return out

    def consume(self, reqs: Iterable[Request]) -> list[str]:
        """Feed each constrained request the tokens it kept; the ids whose grammar is now complete."""
        done = []
        for req in reqs:
            m = self.matchers.get(req.request_id)
            if m is None:
                continue
            self._catch_up(req, m)
            if m.is_terminated and not req.is_finished:
                done.append(req.request_id)
        return done

    def _catch_up(self, req: Request, m: GrammarMatcher) -> None:
        new = req.output_token_ids[m.num_consumed :]
        if not new:
            return
        if not m.consume(new):
            # NOTE: a token outside the mask; the sample stays as it is and is no longer constrained
            self.num_rejected_tokens += 1
            logger.error(
                "%s: token(s) %s break its grammar (%s); its constraint is dropped", req.request_id, new, m.error
            )
            self.matchers.pop(req.request_id, None)
