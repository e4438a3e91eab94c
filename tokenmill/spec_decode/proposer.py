"""The proposer interface and its registry (lazy imports, so n-gram users never load a draft model).

Proposers live in the runner (spec_decode/decoder.py): they draft from the runner's rows, never from the
scheduler's requests, so speculation runs wherever the runner runs (another process, tensor-parallel rank 0).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tokenmill.core.step_io import DraftRequest

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenmill.config import KVCacheSpec, ModelArchConfig, SpeculativeConfig
    from tokenmill.core.step_io import StepInput
    from tokenmill.models.causal_lm import CausalLM
    from tokenmill.spec_decode.eagle_head import TargetTables
    from tokenmill.worker.model_runner import FeatureSink, ModelRunner, RunnerModel

    RunnerFactory = Callable[[RunnerModel, ModelArchConfig, KVCacheSpec, int], ModelRunner]


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may use of the runner it drafts for: the target's handles, its pool's layout, and a factory
    for a runner of its own (a draft model or head with a paged cache), never the engine or the scheduler."""

    target: CausalLM | None
    """The whole target when it runs alone in this process (a self-draft shares its weights, the adaptive
    controller times it); None on tensor-parallel rank 0, whose shard all-reduces with the other ranks in every
    layer and so never runs alone (a self-draft then loads its own copy; the controller learns from steps)."""
    target_arch: ModelArchConfig
    target_model: str
    """The target's checkpoint as the user named it (a draft naming the same one shares its weights)."""
    dtype: torch.dtype
    device: torch.device
    kv_spec: KVCacheSpec
    """The target's KV pool (a draft mirrors its block ids)."""
    max_num_seqs: int
    max_model_len: int
    seed: int
    new_runner: RunnerFactory
    """(model, arch, kv_spec, seed) -> a runner of the draft's own, with the C++ layer loop where its layout has one
    (worker/executor.build_runner passes it; spec_decode never imports the worker)."""
    tables: Callable[[], TargetTables]
    """The target's embedding and LM-head tables, dense (EAGLE and Medusa heads read them), made on first call."""


def draft_budget(req: DraftRequest, gamma: int, max_model_len: int) -> int:
    """Draft depth request `req` may carry: γ, but never past max_tokens (the k accepted drafts plus the
    bonus are all outputs) nor past max_model_len (positions num_tokens - 1 .. num_tokens - 1 + k)."""
    return max(0, min(gamma, req.max_tokens - req.num_output_tokens - 1, max_model_len - req.num_tokens))


@dataclass
class Proposal:
    token_ids: list[list[int]]
    """Per request (in the order asked): up to num_tokens draft tokens; [] = no draft."""
    probs: dict[str, torch.Tensor] | None
    """request id -> [len(drafts), V] q each draft token was drawn from; None = point masses. For a tree:
    row 0 the q at the root, row 1 + u the q at node u (what its sampled children were drawn from)."""
    parents: list[list[int]] | None = None
    """Per request: its drafts are a token tree's nodes with these parents (spec_decode/tree.py); None: chains."""


class Proposer(Protocol):
    feature_sink: FeatureSink | None
    """Given to the target's runner: receives every step's features (EAGLE, the block drafter), or None."""
    feature_layers: tuple[int, ...]
    """The target layers whose outputs the sink receives, side by side ([T, len * H], the block drafter's
    multi-layer features); () = the final hidden states (after the final norm)."""

    def propose(self, requests: list[DraftRequest], num_tokens: list[int]) -> Proposal:
        """Drafts for rows that just sampled (their next step is a decode). `num_tokens[i]` caps request
        i's draft (0 = none): its tokens, or a tree's nodes (a tree proposer caps the depth by
        `draft_budget`). Drafts continue `all_token_ids`."""
        ...

    def forget(self, request_ids: list[str]) -> None:
        """Drop per-request state of requests that left the engine."""
        ...

    def restart(self, request_ids: list[str]) -> None:
        """These rows were rebuilt (preemption freed their blocks, or a beam took tokens back): drop what was
        computed for them, keep their random streams."""
        ...

    def on_step(self, step: StepInput) -> None:
        """Called before the target runs a step (a draft cache mirrors its block copies)."""
        ...


_REGISTRY: dict[str, str] = {
    "ngram": "tokenmill.spec_decode.ngram:NgramProposer",
    "suffix": "tokenmill.spec_decode.ngram:NgramProposer",
    "draft_model": "tokenmill.spec_decode.draft_model:DraftModelProposer",
    "eagle": "tokenmill.spec_decode.eagle:EagleProposer",
    "medusa": "tokenmill.spec_decode.medusa:MedusaProposer",
    "dflash": "tokenmill.spec_decode.dflash:DFlashProposer",
}


def build_proposer(config: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    try:
        target = _REGISTRY[config.method]
    except KeyError:
        raise ValueError(f"unknown speculative method {config.method!r}; known: {sorted(_REGISTRY)}") from None
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls.from_context(config, ctx)
