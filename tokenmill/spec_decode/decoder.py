"""Speculative decoding inside the runner: the proposer, the verifiers and adaptive γ, reading the runner's
own rows (tokens, block tables, hidden states). Nothing here sees the scheduler.

One step of a runner with speculation (worker/model_runner.py):

    on_step(step)           rows that left are forgotten, rebuilt rows restart, block copies mirrored
    target forward          the feature sink gets the hidden states (EAGLE, Medusa)
    verify(...)             requests that carry drafts: rejection sampling (chains) or the tree verifier
    propose(rows)           γ from the cost model; drafts for every row that sampled, continuing the
                            tokens it just got; they go back in StepOutput.drafts

The scheduler stores the drafts on its requests and schedules each as 1 + k tokens next step (or fewer,
when the budget truncates them). q of sampled drafts (draft-model, EAGLE chains) stays here until that
verification.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tokenmill.core.step_io import Drafts, SamplerResult, SamplingRow, StepInput, StepTokens
from tokenmill.layers.sampler import SamplingMetadata
from tokenmill.spec_decode.adaptive import AdaptiveGamma
from tokenmill.spec_decode.proposer import DraftRequest, ProposerContext, build_proposer, draft_budget
from tokenmill.spec_decode.rejection_sampler import RejectionSampler
from tokenmill.spec_decode.stats import SpecDecodeStats
from tokenmill.spec_decode.tree import TreeVerifier

if TYPE_CHECKING:
    from tokenmill.config import SpeculativeConfig
    from tokenmill.models.causal_lm import CausalLM
    from tokenmill.worker.model_runner import FeatureSink


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, ctx: ProposerContext) -> None:
        self.config = config
        self.max_model_len = ctx.max_model_len
        self.stats = SpecDecodeStats()
        self.proposer = build_proposer(config, ctx)
        self.rejection_sampler = RejectionSampler(self.stats)
        self.tree_verifier = TreeVerifier(self.stats)
        self.adaptive = AdaptiveGamma(
            config.tree_max_depth,
            config.adaptive,
            tree_nodes=None if config.tree is None else config.tree.max_nodes,
            one_pass=config.drafts_in_one_pass,
        )
        if config.adaptive and ctx.target is not None:  # a tensor-parallel shard cannot run alone: no prior
            self.adaptive.calibrate(_dense_forward(ctx.target, ctx.device))
        self.draft_probs: dict[str, torch.Tensor] = {}
        """request id -> q of its pending sampled drafts [k, V] (absent: point masses)."""
        self.num_draft_calls = 0
        self.num_draft_steps = 0
        """Sum over proposer calls of the deepest draft asked for (sequential draft passes, for a model drafter)."""
        self.draft_seconds = 0.0
        """Wall seconds in the proposer (benchmarks derive the draft cost c from it)."""

    @property
    def feature_sink(self) -> FeatureSink | None:
        """What the runner hands every step's final hidden states to (the proposer's), or None."""
        return self.proposer.feature_sink

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the sink gets (the proposer's); () = the final hidden states."""
        return self.proposer.feature_layers

    # ------------------------------------------------------------------ rows
    def on_step(self, step: StepInput) -> None:
        """Before the target's forward: drop state of rows that left, restart rows the scheduler rebuilt
        (preemption, a beam taking tokens back), mirror the step's block copies in a draft pool."""
        gone = list(step.finished_ids)
        if gone:
            self.proposer.forget(gone)
        restarted = [*step.preempted_ids, *(d.request_id for d in step.new_requests)]
        if restarted:
            self.proposer.restart(restarted)
        for rid in [*gone, *restarted]:
            self.draft_probs.pop(rid, None)
        self.proposer.on_step(step)

    def observe_target_step(self, batch: list[StepTokens], seconds: float) -> None:
        # The cost model T(n) is fitted to decode/verification steps only: prefill chunks take
        # other kernels and would understate what extra verification tokens cost.
        if batch and all(s.num_new_tokens == 1 + s.num_spec_tokens for s in batch):
            self.adaptive.observe_target_step(sum(s.num_new_tokens for s in batch), seconds)

    # ---------------------------------------------------------------- verify
    def verify(
        self,
        logits: torch.Tensor,
        sampling: list[StepTokens],
        rows: Sequence[SamplingRow],
        meta: SamplingMetadata,
        global_gen: torch.Generator | None,
    ) -> dict[str, SamplerResult]:
        """Logits [sum(k_i + 1), V] for `sampling`, some of which carry drafts."""
        acc0, judged0 = self.stats.num_accepted_tokens, self.stats.num_evaluated_tokens
        probs = {
            s.request_id: self.draft_probs.pop(s.request_id)
            for s in sampling
            if s.num_spec_tokens and s.request_id in self.draft_probs
        }
        if any(s.spec_parents is not None for s in sampling):
            out = self.tree_verifier(logits, sampling, rows, meta, probs, global_gen)
        else:
            out = self.rejection_sampler(logits, sampling, rows, meta, probs, global_gen)
        self.adaptive.observe_acceptance(
            self.stats.num_evaluated_tokens - judged0, self.stats.num_accepted_tokens - acc0
        )
        return out

    # --------------------------------------------------------------- propose
    def propose(self, reqs: list[DraftRequest]) -> dict[str, Drafts]:
        """Drafts for requests that just sampled (their next step is a decode), continuing their tokens."""
        reqs = [r for r in reqs if not r.has_stopped]
        if not reqs:
            return {}
        gamma = self.adaptive.choose(len(reqs))
        budget = self.adaptive.num_draft_tokens(gamma)
        if self.config.tree is None:
            ks = [draft_budget(r, budget, self.max_model_len) for r in reqs]
        else:  # a tree's nodes are not all outputs: the proposer caps its depth (draft_budget) instead
            ks = [budget if draft_budget(r, 1, self.max_model_len) else 0 for r in reqs]
        if self.adaptive.probing:
            ks = self.adaptive.probe_budgets(ks)
        if not any(ks):
            return {}
        t0 = time.perf_counter()
        proposal = self.proposer.propose(reqs, ks)
        seconds = time.perf_counter() - t0
        self.num_draft_calls += 1
        self.num_draft_steps += max(ks)
        self.draft_seconds += seconds
        out: dict[str, Drafts] = {}
        for i, (r, d, k) in enumerate(zip(reqs, proposal.token_ids, ks)):
            self.draft_probs.pop(r.request_id, None)
            if d[:k]:
                out[r.request_id] = Drafts(d[:k], None if proposal.parents is None else proposal.parents[i][:k])
        if proposal.probs is not None:
            self.draft_probs.update({rid: q for rid, q in proposal.probs.items() if rid in out})
        self.adaptive.observe_draft(max(ks), len(reqs), seconds, sum(1 for k in ks if k))
        return out

    def reset_stats(self) -> None:
        """Start the cumulative counters afresh (benchmarks, after a warm-up)."""
        self.stats = self.rejection_sampler.stats = self.tree_verifier.stats = SpecDecodeStats()
        self.num_draft_calls = self.num_draft_steps = 0
        self.draft_seconds = 0.0

    def metrics(self) -> dict[str, float]:
        return {
            **self.stats.as_dict(),
            **self.adaptive.as_dict(),
            "num_draft_calls": self.num_draft_calls,
            "num_draft_steps": self.num_draft_steps,
            "draft_seconds": self.draft_seconds,
        }


def _dense_forward(model: CausalLM, device: torch.device):
    """forward(n): one target pass over n tokens outside the paged cache (cost calibration)."""

    @torch.inference_mode()
    def forward(n: int) -> None:
        ids = torch.zeros(n, dtype=torch.long, device=device)
        h = model(ids, torch.arange(n, device=device))
        model.compute_logits(h[-1:])

    return forward
