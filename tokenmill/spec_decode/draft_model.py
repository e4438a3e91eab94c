"""Draft-model proposer: a small model sharing the target's tokenizer drafts γ tokens
autoregressively, with its own paged KV cache kept in step with the target's.

The draft pool mirrors the target's block ids: target block b's tokens have their draft K/V in
draft block b, so the target's block tables drive the draft too. Positions the target has no
block for yet (the newest token, the drafts themselves) go to scratch blocks past the mirrored
range, handed out afresh on every call:

    draft pool  [ 0 .. num_blocks-1 | scratch: max_num_seqs x (ceil((γ+1)/bs) + 1) ]
                  mirrors the target    per call, per request: positions beyond its table

Per request the proposer remembers how many real tokens have their draft K/V in mirrored
blocks (`num_computed`); each call first catches up from there (the accepted tokens of the last
step plus the newest one, or the whole prompt the first time), then runs γ - 1 one-token steps.
A row the runner rebuilt (preemption freed its blocks) starts over from 0 (`restart`). Draft tokens are sampled from
q = the draft's distribution after the request's own sampling parameters (penalties,
temperature, top-k/p, min-p), which the rejection sampler needs; seeded requests draw from a
generator of their own, separate from the target's.

Caveats that cost acceptance, never exactness: a block the target copies on write keeps the
draft K/V of its source; samples forked from one prompt (n > 1) share a partial last block for
one step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tokenmill.config import KVCacheSpec, ModelArchConfig
from tokenmill.core.step_io import StepInput, StepTokens
from tokenmill.layers.sampler import SamplingMetadata, process_logits, sample_inverse_cdf, uniform_draws
from tokenmill.spec_decode.proposer import DraftRequest, Proposal

if TYPE_CHECKING:
    from tokenmill.config import SpeculativeConfig
    from tokenmill.models.causal_lm import CausalLM
    from tokenmill.spec_decode.proposer import ProposerContext, RunnerFactory
    from tokenmill.worker.model_runner import FeatureSink, RunnerModel


def truncated_layer_ids(num_layers: int, keep: int) -> list[int]:
    """Layers of a layer-truncated self-draft: the first keep - 1 and the last one."""
    if not 1 <= keep <= num_layers:
        raise ValueError(f"draft_num_layers must be in [1, {num_layers}], got {keep}")
    return list(range(keep - 1)) + [num_layers - 1]


def build_draft_model(
    target: CausalLM | None,
    target_arch: ModelArchConfig,
    draft: str,
    target_model: str,
    num_layers: int | None,
    dtype: torch.dtype,
    device: str,
) -> tuple[CausalLM, ModelArchConfig]:
    """The draft network. Naming the target's own checkpoint shares its weights (no copy) when the whole target
    is at hand (`target`; None: a tensor-parallel shard, so the checkpoint loads again, whole); with num_layers it
    keeps only truncated_layer_ids(...) of them."""
    from tokenmill.layers.linear import Linear
    from tokenmill.models.loader import load_model, reset_buffers, resolve_model_path
    from tokenmill.quant.gguf import GGUFEmbedding, GGUFLinearMethod, install_gguf, register_blocks

    if target is not None and resolve_model_path(draft).resolve() == resolve_model_path(target_model).resolve():
        source, arch = target, target_arch
    else:
        loaded = load_model(draft, dtype=dtype, device=device, load_tokenizer=False)
        source, arch = loaded.model, loaded.config
        if arch.vocab_size != target_arch.vocab_size:
            raise ValueError(
                f"draft model {draft} has vocab {arch.vocab_size}, the target {target_arch.vocab_size}: "
                f"the draft must share the target's tokenizer"
            )
    layer_ids = truncated_layer_ids(arch.num_hidden_layers, num_layers or arch.num_hidden_layers)
    if source is not target and len(layer_ids) == arch.num_hidden_layers:
        return source, arch
    # Same class on the meta device, then point every parameter at the source's tensor.
    draft_arch = dataclasses.replace(arch, num_hidden_layers=len(layer_ids))
    with torch.device("meta"):
        # every model class (a CausalLM subclass) is built as cls(cfg, dtype=...); CausalLM's own takes the body
        net = type(source)(draft_arch, dtype=dtype)  # type: ignore[call-arg]
    rename = {f"model.layers.{i}.": f"model.layers.{j}." for i, j in enumerate(layer_ids)}

    def source_name(name: str) -> str:
        for new, old in rename.items():
            if name.startswith(new):
                return old + name[len(new) :]
        return name

    # GGUF blocks (quant/gguf.py) have no parameters: the draft's linears read the source's blocks, and a GGUF
    # token table is shared whole (it is bound to no KV cache)
    src_modules = dict(source.named_modules())
    if isinstance(source.model.embed_tokens, GGUFEmbedding):
        net.model.embed_tokens = source.model.embed_tokens
    for name, mod in list(net.named_modules()):
        src = src_modules.get(source_name(name))
        if isinstance(mod, Linear) and isinstance(src, Linear) and isinstance(src.quant_method, GGUFLinearMethod):
            install_gguf(mod, src.quant_method.parts)
    src_params = dict(source.named_parameters())
    for name, _ in list(net.named_parameters()):
        module_path, _, leaf = name.rpartition(".")
        setattr(net.get_submodule(module_path), leaf, src_params[source_name(name)])
    register_blocks(net)
    reset_buffers(net, device)
    for name, buf in net.named_buffers():
        assert buf.device.type != "meta", f"draft buffer {name} left on meta"
    net.eval()
    net.process_weights_after_loading()  # its own linears' kernel copies (the parameters are shared)
    return net, draft_arch


def take_rows(meta: SamplingMetadata, idx: list[int]) -> SamplingMetadata:
    """The metadata of rows idx only."""
    t = torch.tensor(idx, dtype=torch.long, device=meta.temperature.device)

    def pick(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[t]

    return dataclasses.replace(
        meta,
        temperature=meta.temperature[t],
        top_k=pick(meta.top_k),
        top_p=pick(meta.top_p),
        min_p=pick(meta.min_p),
        presence_penalty=pick(meta.presence_penalty),
        frequency_penalty=pick(meta.frequency_penalty),
        repetition_penalty=pick(meta.repetition_penalty),
        output_counts=pick(meta.output_counts),
        prompt_mask=pick(meta.prompt_mask),
        min_tokens_mask=pick(meta.min_tokens_mask),
        generators=[meta.generators[i] for i in idx],
        allowed=pick(meta.allowed),
        allowed_per_position=None,
    )


def advance(meta: SamplingMetadata, tokens: torch.Tensor, num_generated: list[int], min_tokens: list[int]) -> None:
    """In place: rows just drew `tokens` [N]; num_generated counts them already."""
    if meta.output_counts is not None:
        meta.output_counts = meta.output_counts.clone()
        meta.output_counts[torch.arange(len(tokens)), tokens] += 1
    if meta.min_tokens_mask is not None:
        meta.min_tokens_mask = meta.min_tokens_mask.clone()
        for i, (n, mt) in enumerate(zip(num_generated, min_tokens)):
            if n >= mt:
                meta.min_tokens_mask[i] = False


def draft_loop(
    reqs: list[DraftRequest],
    ks: list[int],
    meta: SamplingMetadata,
    logits: torch.Tensor,
    sample: Callable[[torch.Tensor, SamplingMetadata], tuple[torch.Tensor, torch.Tensor | None]],
    step: Callable[[list[int], list[int], int, list[int]], torch.Tensor],
) -> tuple[dict[str, list[int]], dict[str, torch.Tensor] | None]:
    """Autoregressive drafting shared by the proposers: sample draft j + 1 of every request still
    drafting from `logits`, then `step(alive, keep, j, last)` returns the next logits for the
    requests `alive` (indices into reqs) given their last drafts; `keep` are the rows of the
    previous alive list that remain. Request i drafts ks[i] tokens. Returns the drafts and, unless
    every row is greedy, q per request [k_i, V]."""
    drafts: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
    all_greedy = meta.all_greedy
    alive = list(range(len(reqs)))
    for j in range(max(ks)):
        tok, q = sample(logits, meta)
        toks = tok.tolist()
        for row, i in enumerate(alive):
            drafts[reqs[i].request_id].append(toks[row])
            if not all_greedy:
                assert q is not None  # sample returns no q only when every row is greedy
                probs[reqs[i].request_id].append(q[row])
        keep = [row for row, i in enumerate(alive) if ks[i] > j + 1]
        if not keep:
            break
        advance(
            meta,
            tok,
            [reqs[i].num_output_tokens + j + 1 for i in alive],
            [reqs[i].sampling_params.min_tokens for i in alive],
        )
        if len(keep) < len(alive):
            meta = take_rows(meta, keep)
            alive = [alive[row] for row in keep]
        logits = step(alive, keep, j, [drafts[reqs[i].request_id][-1] for i in alive])
    return drafts, None if all_greedy else {rid: torch.stack(p) for rid, p in probs.items() if p}


class DraftModelProposer:
    def __init__(
        self,
        model: RunnerModel,
        arch: ModelArchConfig,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        gamma_max: int,
        max_num_seqs: int,
        new_runner: RunnerFactory,
        seed: int = 0,
    ) -> None:
        self.block_size = block_size
        self.num_mirrored_blocks = num_blocks
        scratch = max_num_seqs * (-(-(gamma_max + 1) // block_size) + 1)
        spec = KVCacheSpec(
            num_blocks + scratch, block_size, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, kv_dtype
        )
        self.runner = new_runner(model, arch, spec, seed + 1)
        self.feature_sink: FeatureSink | None = None  # drafts from its own layers
        self.feature_layers: tuple[int, ...] = ()  # the final hidden states, if any
        self.num_computed: dict[str, int] = {}
        """request id -> real tokens with draft K/V in mirrored blocks."""

    @classmethod
    def from_context(cls, config: SpeculativeConfig, ctx: ProposerContext) -> DraftModelProposer:
        assert config.model is not None  # SpeculativeConfig requires it for method draft_model
        model, arch = build_draft_model(
            ctx.target,
            ctx.target_arch,
            config.model,
            ctx.target_model,
            config.draft_num_layers,
            ctx.dtype,
            str(ctx.device),
        )
        return cls(model, arch, **cls.pool_args(config, ctx))

    @staticmethod
    def pool_args(config: SpeculativeConfig, ctx: ProposerContext) -> dict:
        """Constructor arguments that size the mirrored pool after the target's."""
        kv = ctx.kv_spec
        return dict(
            num_blocks=kv.num_blocks,
            block_size=kv.block_size,
            kv_dtype=kv.dtype if kv.dtype.is_floating_point else ctx.dtype,
            gamma_max=config.max_draft_tokens,
            max_num_seqs=ctx.max_num_seqs,
            new_runner=ctx.new_runner,
            seed=ctx.seed,
        )

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.num_computed.pop(rid, None)
        self.runner.forget(request_ids)

    def restart(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.num_computed.pop(rid, None)

    def on_step(self, step: StepInput) -> None:
        self.runner.copy_blocks(step.block_copies)  # the target's copy-on-write, in the mirrored pool too

    # ---------------------------------------------------------------- propose
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], num_tokens: list[int]) -> Proposal:
        bs = self.block_size
        active = [(r, k) for r, k in zip(requests, num_tokens) if k > 0]
        if not active:
            return Proposal([[] for _ in requests], None)
        next_scratch = self.num_mirrored_blocks
        tables: list[list[int]] = []
        catch_up: list[StepTokens] = []
        for r, k in active:
            real = r.block_ids
            done = min(self.num_computed.get(r.request_id, 0), len(real) * bs, r.num_tokens - 1)
            num_needed = -(-(r.num_tokens + k - 1) // bs)  # positions up to num_tokens + k - 2
            extra = max(0, num_needed - len(real))
            table = real + list(range(next_scratch, next_scratch + extra))
            next_scratch += extra
            assert next_scratch <= self.runner.kv_spec.num_blocks, "draft scratch blocks exhausted"
            tables.append(table)
            catch_up.append(StepTokens(r.request_id, done, r.all_token_ids[done:], table))
            self.num_computed[r.request_id] = min(r.num_tokens, len(real) * bs)

        reqs = [r for r, _ in active]
        ks = [k for _, k in active]
        meta = self.runner.sampling_metadata(reqs)  # the target requests' parameters; the draft's own generators

        def step(alive: list[int], keep: list[int], j: int, last: list[int]) -> torch.Tensor:
            return self._forward(
                [StepTokens(reqs[i].request_id, reqs[i].num_tokens + j, [t], tables[i]) for i, t in zip(alive, last)]
            )

        drafts, probs = draft_loop(reqs, ks, meta, self._forward(catch_up), self._sample, step)
        return Proposal([drafts.get(r.request_id, []) for r in requests], probs)

    def _forward(self, slices: list[StepTokens]) -> torch.Tensor:
        """Logits [len(slices), V] at each slice's last token, in slice order."""
        order = sorted(range(len(slices)), key=lambda i: slices[i].num_new_tokens != 1)  # decodes first
        inp = self.runner.prepare_inputs([slices[i] for i in order])
        hidden = self.runner.run_model(inp)  # the C++ layer loop where it serves the step, as for the target
        logits_sorted = self.runner.model.compute_logits(hidden[inp.logits_indices])
        logits = torch.empty_like(logits_sorted)
        logits[torch.tensor(order, device=logits.device)] = logits_sorted
        return logits

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [N] and q [N, V] (None when every row is greedy)."""
        processed = process_logits(logits.float(), meta)
        greedy = processed.argmax(-1)
        if meta.all_greedy:
            return greedy, None
        q = processed.softmax(-1)
        drawn = sample_inverse_cdf(q, uniform_draws(meta.generators, q.device, self.runner.sampler.global_gen))
        tok = torch.where(meta.temperature > 0, drawn, greedy)
        return tok, q
