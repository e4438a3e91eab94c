"""Glue between the engine loop and speculative decoding.

One engine step with speculation:

    scheduler.schedule()    drafts set last step are scheduled as 1 + k tokens of their request
    execute(runner, sched)  target pass; the runner hands rows of drafted requests to `verify`
    scheduler.update()      accepted tokens appended, rejected slots rolled back
    propose(scheduler)      γ from the cost model; the proposer drafts for requests about to decode

Drafts live in `Request.spec_token_ids`; their q (draft-model proposer) stays here until the next
verification. Preemption clears a request's drafts (the scheduler does it).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from tokenmill.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.core.step_io import SamplerResult, SamplingRow, StepTokens
from tokenmill.layers.sampler import SamplingMetadata
from tokenmill.request import Request, RequestStatus
from tokenmill.spec_decode.adaptive import AdaptiveGamma
from tokenmill.spec_decode.proposer import ProposerContext, build_proposer, draft_budget
from tokenmill.spec_decode.rejection_sampler import RejectionSampler
from tokenmill.spec_decode.stats import SpecDecodeStats
from tokenmill.spec_decode.tree import TreeVerifier

if TYPE_CHECKING:
    from tokenmill.config import SpeculativeConfig
    from tokenmill.worker.model_runner import ModelRunner


class SpeculativeDecoder:
    def __init__(self, config: "SpeculativeConfig", ctx: ProposerContext) -> None:
        self.config = config
        self.max_model_len = ctx.max_model_len
        self.stats = SpecDecodeStats()
        self.proposer = build_proposer(config, ctx)
        self.rejection_sampler = RejectionSampler(self.stats)
        self.tree_verifier = TreeVerifier(self.stats)
        self.adaptive = AdaptiveGamma(config.tree_max_depth, config.adaptive,
                                      tree_nodes=None if config.tree is None else config.tree.max_nodes)
        if config.adaptive:
            self.adaptive.calibrate(_dense_forward(ctx.target, ctx.device))
        self.draft_probs: dict[str, torch.Tensor] = {}
        self._known: set[str] = set()

    # ------------------------------------------------------------------ target
    def execute(self, runner: "ModelRunner", sched: SchedulerOutput) -> dict[str, SamplerResult]:
        self.proposer.on_schedule(sched)
        t0 = time.perf_counter()
        results = runner.execute(sched.step)
        # The cost model T(n) is fitted to decode/verification steps only: prefill chunks take
        # other kernels and would understate what extra verification tokens cost.
        if all(s.num_new_tokens == 1 + s.num_spec_tokens for s in sched.scheduled):
            self.adaptive.observe_target_step(sched.num_tokens, time.perf_counter() - t0)
        return results

    def verify(self, logits: torch.Tensor, sampling: list[StepTokens], rows: list[SamplingRow],
               meta: SamplingMetadata, global_gen: torch.Generator | None) -> dict[str, SamplerResult]:
        """The runner's verification hook: logits [sum(k_i + 1), V] for `sampling`."""
        acc0, judged0 = self.stats.num_accepted_tokens, self.stats.num_evaluated_tokens
        if any(s.spec_parents is not None for s in sampling):
            out = self.tree_verifier(logits, sampling, rows, meta, self.draft_probs, global_gen)
        else:
            out = self.rejection_sampler(logits, sampling, rows, meta, self.draft_probs, global_gen)
        self.adaptive.observe_acceptance(self.stats.num_evaluated_tokens - judged0,
                                         self.stats.num_accepted_tokens - acc0)
        return out

    # ---------------------------------------------------------------- proposer
    def propose(self, scheduler: Scheduler) -> None:
        """Set spec_token_ids of running requests whose next step is a decode."""
        live = set(scheduler.requests)
        gone = self._known - live
        if gone:
            self.proposer.forget(list(gone))
        self._known = live
        reqs = [r for r in scheduler.running
                if r.status == RequestStatus.RUNNING and r.num_computed_tokens == r.num_tokens - 1]
        self.draft_probs = {}
        if not reqs:
            return
        gamma = self.adaptive.choose(len(reqs))
        budget = self.adaptive.num_draft_tokens(gamma)
        if self.config.tree is None:
            ks = [draft_budget(r, budget, self.max_model_len) for r in reqs]
        else:  # a tree's nodes are not all outputs: the proposer caps its depth (draft_budget) instead
            ks = [budget if draft_budget(r, 1, self.max_model_len) else 0 for r in reqs]
        if not any(ks):
            return
        t0 = time.perf_counter()
        proposal = self.proposer.propose(reqs, ks)
        seconds = time.perf_counter() - t0
        for i, (r, d, k) in enumerate(zip(reqs, proposal.token_ids, ks)):
            r.set_drafts(d[:k], None if proposal.parents is None else proposal.parents[i][:k])
        if proposal.probs is not None:
            self.draft_probs = proposal.probs
        self.adaptive.observe_draft(max(ks), len(reqs), seconds)

    def reset_stats(self) -> None:
        """Start the cumulative counters afresh (benchmarks, after a warm-up)."""
        self.stats = self.rejection_sampler.stats = self.tree_verifier.stats = SpecDecodeStats()

    def metrics(self) -> dict[str, float]:
        return {**self.stats.as_dict(), **self.adaptive.as_dict()}


def _dense_forward(model: torch.nn.Module, device: torch.device):
    """forward(n): one target pass over n tokens outside the paged cache (cost calibration)."""
    @torch.inference_mode()
    def forward(n: int) -> None:
        ids = torch.zeros(n, dtype=torch.long, device=device)
        h = model(ids, torch.arange(n, device=device))
        model.compute_logits(h[-1:])
    return forward
