"""Turns a SchedulerOutput into tensors, runs the model, samples.

Flattening one step (block_size 4; A decodes, B prefills a chunk of 3 after 2 cached tokens):

    scheduled        A: start 5, 1 token, blocks [7, 2]     B: start 2, 3 tokens, blocks [4, 9]
    input_ids        [a5,            b2, b3, b4]
    positions        [5,             2,  3,  4]
    slot_mapping     [2*4+1=9,       4*4+2=18, 4*4+3=19, 9*4+0=36]
    query_start_loc  [0, 1, 4]
    seq_lens         [6, 5]
    logits_indices   [0, 3]          (last token of each request that samples)

Decodes (one new token) are put first so attention can batch them.

The runner never sees a scheduler `Request`: it keeps a `RequestState` row per request, built from the
`NewRequestData` the scheduler sends once and advanced by each step's `ScheduledChunk` deltas
(core/step_io.py), so it can run in another process (tests/worker/test_runner_process.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tokenmill.attention.metadata import (
    AttentionKind,
    AttentionMetadata,
    forward_context,
    plan_attention,
    tree_depths,
    tree_key_masks,
)
from tokenmill.config import KVCacheGroup, KVCacheSpec, ModelArchConfig
from tokenmill.core.step_io import (
    BlockCopy,
    DraftRequest,
    NewRequestData,
    PathMove,
    SamplerResult,
    SamplingRow,
    ScheduledChunk,
    StepInput,
    StepOutput,
    StepTokens,
)
from tokenmill.layers.sampler import (
    TARGET_STREAM,
    Sampler,
    SamplingMetadata,
    masks_from_bytes,
    sampling_metadata,
)
from tokenmill.models.interface import LayerTaps
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import cpu_decode
from tokenmill.worker.kv_cache_ops import add_forked_samples, compact_accepted_path, copy_blocks
from tokenmill.worker.prompt_outputs import PromptOutputs, prompt_outputs

if TYPE_CHECKING:
    from tokenmill.models.interface import DecoderLayout
    from tokenmill.models.llama import LlamaAttention
    from tokenmill.spec_decode.decoder import SpeculativeDecoder


class RunnerModel(Protocol):
    """What a runner uses of its model: the target (models/causal_lm.py's CausalLM) or a draft's (a draft
    CausalLM, or EAGLE's head, whose proposer calls it with features itself and never through run_model)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, taps: LayerTaps | None = None) -> torch.Tensor:
        """Final hidden states; `taps` (a target only) also collects chosen layers' outputs."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def decoder_layout(self) -> DecoderLayout | None: ...

    def attention_layers(self) -> list[LlamaAttention]: ...


@dataclass(slots=True)
class RequestState:
    """The runner's row for one request: what it was sent, never what it sampled (step_io.py)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    """Prompt + outputs the scheduler has confirmed."""
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    group_block_ids: list[list[int]]
    """KV-cache groups 1.. (sliding-window models): their tables."""
    max_tokens: int
    """Outputs the request may have in all (NewRequestData.max_tokens)."""
    cache_salt: str | None = None
    """Its tenant (NewRequestData.cache_salt)."""
    pool_sum: torch.Tensor | None = None  # [hidden_size] float32
    """Mean pooling: the sum of the final hidden states of positions [0, num_pooled) (worker/prompt_outputs.py)."""
    num_pooled: int = 0

    @classmethod
    def new(cls, d: NewRequestData) -> RequestState:
        return cls(
            d.request_id,
            list(d.prompt_token_ids),
            list(d.prompt_token_ids) + list(d.output_token_ids),
            d.sampling_params,
            d.eos_token_id,
            list(d.block_ids),
            [list(t) for t in d.group_block_ids],
            d.max_tokens,
            d.cache_salt,
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def advance(self, c: ScheduledChunk) -> StepTokens:
        """Apply a step's delta; the tokens to compute this step."""
        self.token_ids.extend(c.new_token_ids)
        if c.replace_block_ids:
            self.block_ids = list(c.new_block_ids)
            self.group_block_ids = [list(t) for t in c.new_group_block_ids]
        else:
            self.block_ids.extend(c.new_block_ids)
            for t, new in zip(self.group_block_ids, c.new_group_block_ids):
                t.extend(new)
        end = c.start_pos + c.num_new_tokens
        k = len(c.spec_token_ids)
        real_end = end - k
        assert real_end <= len(self.token_ids), f"{self.request_id}: chunk past the tokens the runner was sent"
        toks = self.token_ids[c.start_pos : real_end] + list(c.spec_token_ids)
        return StepTokens(
            self.request_id,
            c.start_pos,
            toks,
            self.block_ids,
            k,
            c.is_sampling,
            c.fork_of,
            c.spec_parents,
            self.group_block_ids,
        )


@dataclass
class StepInputs:
    """A forward pass's tensors, from `ModelRunner.prepare_inputs`."""

    meta: AttentionMetadata
    """KV-cache group 0's (every layer's, for a one-group model)."""
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    logits_indices: torch.Tensor  # rows of the hidden states whose logits are sampled
    sampling: list[StepTokens]
    """The requests that sample, in logits order (a request with k drafts owns 1 + k rows)."""
    group_metas: list[AttentionMetadata] = dataclasses.field(default_factory=list)
    """Groups 1.. : the same step over their own block tables (and windows)."""


FeatureSink = Callable[[list[StepTokens], torch.Tensor], None]
"""(the step's requests in input order, features [num_tokens, F]) -> None (EAGLE's store, the block drafter's).
The features are the final hidden states, or, when the proposer names `feature_layers`, those target layers'
outputs side by side (models/interface.py's LayerTaps). After a verification step it gets only the tokens that
stay (`kept_rows`)."""


def kept_rows(
    batch: list[StepTokens], hidden: torch.Tensor, results: dict[str, SamplerResult]
) -> tuple[list[StepTokens], torch.Tensor]:
    """A verification step as the feature sink sees it: each request's real tokens and accepted drafts, in
    position order, with their hidden rows; rejected drafts (and a tree's other branches) dropped.

        A: start 9, tokens [r, x, y, z] (3 drafts), tree accepted nodes [1]  ->  A: start 9, [r, y], rows 0, 2
    """
    out: list[StepTokens] = []
    idx: list[int] = []
    off = 0
    for s in batch:
        n, k = s.num_new_tokens, s.num_spec_tokens
        res = results.get(s.request_id)
        if k == 0 or res is None:
            out.append(s)
            idx.extend(range(off, off + n))
        else:
            real = n - k
            acc = res.accepted_nodes if res.accepted_nodes is not None else list(range(len(res.token_ids) - 1))
            out.append(
                StepTokens(
                    s.request_id,
                    s.start_pos,
                    s.token_ids[:real] + [s.token_ids[real + a] for a in acc],
                    s.block_ids,
                    0,
                    s.is_sampling,
                    s.fork_of,
                )
            )
            idx.extend(range(off, off + real))
            idx.extend(off + real + a for a in acc)
        off += n
    return out, hidden.index_select(0, torch.tensor(idx, dtype=torch.long, device=hidden.device))


@dataclass
class Sampled:
    """What `ModelRunner.sample` decided: each sampling request's tokens, and the K/V moves of verified trees."""

    results: dict[str, SamplerResult]
    path_moves: list[PathMove] = dataclasses.field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: RunnerModel,
        arch: ModelArchConfig,
        kv_spec: KVCacheSpec,
        device: torch.device,
        seed: int = 0,
        speculator: SpeculativeDecoder | None = None,
        use_decode_loop: bool = True,
        prompts_per_token: bool = False,
        samples: bool = True,
        sample_stream: int = TARGET_STREAM,
    ) -> None:
        """speculator: speculative decoding (spec_decode/decoder.py): it verifies steps with drafts, gets every
        step's final hidden states when its proposer drafts from the target's features, and proposes drafts for
        the rows that sampled; use_decode_loop: False keeps every step on the module path (a tensor-parallel
        shard: its layers all-reduce, which the C++ loop does not); prompts_per_token: prompt chunks are attended
        token by token (ModelConfig.attends_prompts_per_token): every step's attention plan is PER_TOKEN
        (attention/metadata.py), so the C++ loop serves prompt chunks like decodes;
        samples: False for a tensor-parallel rank > 0, which computes the logits (their vocabulary gather is a
        collective) and returns no tokens (rank 0 samples, verifies and proposes)."""
        self.model = model  # weights already processed for their kernels (load_model)
        self.arch = arch
        self.kv_spec = kv_spec
        self.device = device
        self.block_size = kv_spec.block_size
        self.vocab_size = arch.vocab_size
        # [layers per block] x [2, num_blocks, block_size, num_kv_heads, head_dim]: the pool's storage. With
        # several KV-cache groups, layer i of every group lives in tensor i (a block serves one group).
        self.kv_tensors = [
            torch.zeros(
                2,
                kv_spec.num_blocks,
                kv_spec.block_size,
                kv_spec.num_kv_heads,
                kv_spec.cache_head_dim,
                dtype=kv_spec.dtype,
                device=device,
            )
            for _ in range(kv_spec.num_layers)
        ]
        self.groups = list(kv_spec.groups) or [KVCacheGroup(tuple(range(kv_spec.num_layers)))]
        layer_tensor = {layer: i for grp in self.groups for i, layer in enumerate(grp.layers)}
        self.kv_caches = [self.kv_tensors[layer_tensor[i]] for i in range(len(layer_tensor))]
        """Per layer, its cache tensor (shared across groups)."""
        for attn, cache in zip(model.attention_layers(), self.kv_caches):
            attn.kv_cache = cache
        # Steps of a few tokens per request on CPU: the C++ layer loop (worker/cpu_decode.py), or None.
        self.decode_loop = (
            cpu_decode.build(model.decoder_layout(), self.kv_caches)
            if device.type == "cpu" and use_decode_loop
            else None
        )
        self.sampler = Sampler(seed, device=str(device))
        self.generators: dict[str, torch.Generator] = {}
        self.requests: dict[str, RequestState] = {}
        """The persistent batch: one row per request the scheduler has sent and not dropped."""
        self.pooling_rows: set[str] = set()
        """Rows of embedding requests (SamplingParams.pooling): steps with none of them and no chunk that wants
        prompt logprobs skip worker/prompt_outputs.py altogether."""
        self.speculator = speculator
        self.feature_sink: FeatureSink | None = speculator.feature_sink if speculator is not None else None
        self.feature_layers: tuple[int, ...] = speculator.feature_layers if speculator is not None else ()
        """Target layers whose outputs the sink gets instead of the final hidden states; () = the final ones."""
        self.prompts_per_token = prompts_per_token
        self.samples = samples
        self.sample_stream = sample_stream
        """Which random stream of a seeded request this runner's generators draw (layers/sampler.py's streams):
        the target's, or DRAFT_STREAM in a proposer's runner."""
        self.num_paths_compacted = 0
        """Verified token trees whose accepted path was not already in consecutive slots (tests read it)."""

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop requests' rows and random generators (they left the engine)."""
        for rid in request_ids:
            self.requests.pop(rid, None)
            self.pooling_rows.discard(rid)
            self.generators.pop(rid, None)

    # ----------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """One step: apply the step's row deltas, run the forward, sample or verify, propose drafts."""
        if self.speculator is not None:
            self.speculator.on_step(step)
        self.forget(step.finished_ids)
        for rid in step.preempted_ids:  # its generator stays: a resumed request continues its stream
            self.requests.pop(rid, None)
            self.pooling_rows.discard(rid)
        for d in step.new_requests:
            self.requests[d.request_id] = RequestState.new(d)
            if d.sampling_params.pooling is not None:
                self.pooling_rows.add(d.request_id)
        self.copy_blocks(step.block_copies)
        if not step.scheduled:
            return StepOutput(spec_metrics=self.speculator.metrics() if self.speculator is not None else None)
        t0 = time.perf_counter()
        tokens = [self.requests[c.request_id].advance(c) for c in step.scheduled]
        forked = [self.requests[c.request_id].advance(c) for c in step.forked]
        batch = sorted(tokens, key=lambda s: s.num_new_tokens != 1)  # decodes first (stable)
        inp = self.prepare_inputs(batch)
        logits_indices, sampling = inp.logits_indices, inp.sampling
        if forked:
            logits_indices, sampling = add_forked_samples(forked, logits_indices, sampling)
        want_taps = self.feature_sink is not None and self.feature_layers
        taps = LayerTaps(self.feature_layers, self.arch.hidden_size) if want_taps else None
        hidden = self.run_model(inp, taps)  # [num_tokens, hidden]
        features = hidden if taps is None else taps.buffer(hidden)
        prompt = PromptOutputs()
        if self.pooling_rows or any(c.wants_prompt_logprobs for c in step.scheduled):
            prompt = prompt_outputs(step, batch, self.requests, hidden, self.model.compute_logits)
        if self.feature_sink is not None and not any(s.num_spec_tokens for s in batch):
            self.feature_sink(batch, features)
        if not sampling:
            return StepOutput(
                spec_metrics=self.speculator.metrics() if self.speculator is not None else None,
                prompt_logprobs=prompt.prompt_logprobs,
                pooled=prompt.pooled,
            )
        sampled = self.sample(step, batch, sampling, hidden, logits_indices, features)
        if self.speculator is None:
            return StepOutput(sampled.results, prompt_logprobs=prompt.prompt_logprobs, pooled=prompt.pooled)
        self.speculator.observe_target_step(batch, time.perf_counter() - t0)
        drafts = self.speculator.propose(self.draft_requests(sampling, sampled.results))
        return StepOutput(
            sampled.results,
            drafts,
            self.speculator.metrics(),
            sampled.path_moves,
            prompt.prompt_logprobs,
            prompt.pooled,
        )

    def run_model(self, inp: StepInputs, taps: LayerTaps | None = None) -> torch.Tensor:
        """The forward over a step's inputs: the C++ layer loop where it serves the step (its attention plan and
        size), else the model's modules. Final hidden states [num_tokens, hidden]; `taps` also gets chosen
        layers' outputs, from either forward."""
        loop = self.decode_loop
        if loop is not None and loop.serves(inp.meta, inp.input_ids.shape[0], inp.group_metas):
            return loop(inp.input_ids, inp.positions, inp.meta, inp.group_metas, taps)
        with forward_context(inp.meta, inp.group_metas):
            if taps is None:
                return self.model(inp.input_ids, inp.positions)
            return self.model(inp.input_ids, inp.positions, taps)

    def run_rows(self, inp: StepInputs, rows: torch.Tensor) -> torch.Tensor | None:
        """The C++ layer loop over given input rows [num_tokens, hidden] in place of the embedded tokens (a draft
        head fed by its own input projection), or None when the loop does not serve the step (the caller then runs
        its modules)."""
        loop = self.decode_loop
        if loop is not None and loop.serves(inp.meta, inp.input_ids.shape[0], inp.group_metas):
            return loop.forward_rows(rows, inp.positions, inp.meta, inp.group_metas)
        return None

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Copy-on-write: each copy's source block into its destination, in every layer's cache."""
        if copies:
            copy_blocks(self.kv_tensors, copies)

    def sample(
        self,
        step: StepInput,
        batch: list[StepTokens],
        sampling: list[StepTokens],
        hidden: torch.Tensor,
        logits_indices: torch.Tensor,
        features: torch.Tensor,
    ) -> Sampled:
        """The step's tokens: sampled from the logits at `logits_indices`, or, for requests with drafts, the
        speculator's verdict (whose accepted tree paths are then moved into consecutive slots); the feature sink
        gets the `features` rows that stay."""
        logits = self.model.compute_logits(hidden[logits_indices])  # [num_sampling, vocab]
        if not self.samples:
            return Sampled({})
        rows = [self.requests[s.request_id] for s in sampling]
        smeta = self.sampling_metadata(rows)
        verify = self.speculator is not None and any(s.num_spec_tokens for s in sampling)
        if step.token_masks:
            smeta = self.with_grammar_masks(smeta, rows, step.token_masks, per_position=verify)
        if not verify:
            out = self.sampler(logits, smeta, [r.sampling_params.logprobs for r in rows])
            toks = out.token_ids.tolist()
            return Sampled(
                {
                    r.request_id: SamplerResult(
                        [toks[i]], None if out.logprobs is None or out.logprobs[i] is None else [out.logprobs[i]]
                    )
                    for i, r in enumerate(rows)
                }
            )
        assert self.speculator is not None
        moves: list[PathMove] = []
        results = self.speculator.verify(logits, sampling, rows, smeta, self.sampler.global_gen)
        for s in sampling:  # a verified tree: its accepted path's K/V into consecutive slots
            res = results.get(s.request_id)
            if s.tree_parents is not None and res is not None and res.accepted_nodes:
                self.num_paths_compacted += res.accepted_nodes != list(range(len(res.accepted_nodes)))
                base = s.start_pos + s.num_new_tokens - s.num_spec_tokens
                # each group's layers sit at its own blocks in every tensor
                moves.extend(PathMove(table, base, res.accepted_nodes) for table in s.tables())
        self.move_paths(moves)
        if self.feature_sink is not None:
            self.feature_sink(*kept_rows(batch, features, results))
        return Sampled(results, moves)

    def move_paths(self, moves: Sequence[PathMove]) -> None:
        """Verified token trees: each accepted path's K/V into consecutive slots (every layer), in order."""
        for m in moves:
            compact_accepted_path(self.kv_tensors, m.block_ids, m.base, m.accepted_nodes)

    def draft_requests(self, sampling: list[StepTokens], results: dict[str, SamplerResult]) -> list[DraftRequest]:
        """The rows that sampled this step as the proposer sees them: their tokens with the sampled ones."""
        out = []
        for s in sampling:
            res = results.get(s.request_id)
            if res is None:
                continue
            row = self.requests[s.request_id]
            out.append(
                DraftRequest(
                    row.request_id,
                    row.prompt_token_ids,
                    row.token_ids + res.token_ids,
                    row.block_ids,
                    row.sampling_params,
                    row.eos_token_id,
                    row.max_tokens,
                    row.cache_salt,
                )
            )
        return out

    def with_grammar_masks(
        self, meta: SamplingMetadata, rows: Sequence[SamplingRow], masks: dict[str, bytes], per_position: bool
    ) -> SamplingMetadata:
        """Structured outputs: each row's allowed tokens (StepInput.token_masks) on the metadata; with drafts,
        one mask per verified position (the verifier expands them with its rows)."""
        V = self.vocab_size
        words = (V + 31) // 32
        unpacked = [
            masks_from_bytes(masks[r.request_id], words, V).to(self.device) if r.request_id in masks else None
            for r in rows
        ]
        if per_position:
            return dataclasses.replace(meta, allowed_per_position=unpacked)
        allowed = torch.ones(len(rows), V, dtype=torch.bool, device=self.device)
        for i, m in enumerate(unpacked):
            if m is not None:
                allowed[i] = m[0]
        return dataclasses.replace(meta, allowed=allowed)

    def prepare_inputs(self, batch: list[StepTokens]) -> StepInputs:
        """The tensors of one forward pass over `batch` (decodes first, as `execute` orders them)."""
        input_ids: list[int] = []
        positions: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling: list[StepTokens] = []
        key_lens: list[int] = []  # per token: its slot index in its request + 1 (the keys it may see)
        key_masks: list[int] | None = None
        for s in batch:
            n, start = s.num_new_tokens, s.start_pos
            input_ids.extend(s.token_ids)
            tree = s.tree_parents
            if tree is None:
                positions.extend(range(start, start + n))
            else:  # a token tree: nodes at the root's position + depth, in slots after the root in listing order
                k = s.num_spec_tokens
                root = start + n - k - 1
                positions.extend(range(start, root + 1))
                positions.extend(root + d for d in tree_depths(tree))
                if key_masks is None:
                    key_masks = [0] * len(key_lens)
                key_masks.extend([0] * (n - k))
                key_masks.extend(tree_key_masks(tree))
            if key_masks is not None and tree is None:
                key_masks.extend([0] * n)
            key_lens.extend(range(start + 1, start + n + 1))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            if s.is_sampling:  # a request with k drafts needs logits at its last 1 + k tokens
                logits_indices.extend(range(qsl[-1] - 1 - s.num_spec_tokens, qsl[-1]))
                sampling.append(s)
        num_decodes = 0  # decodes were sorted first
        for s in batch:
            if s.num_new_tokens != 1:
                break
            num_decodes += 1
        dev = self.device
        max_dec = max(seq_lens[:num_decodes], default=0)
        counts = [s.num_new_tokens for s in batch]
        kinds = [
            plan_attention(counts, not self.prompts_per_token, grp.sliding_window is not None) for grp in self.groups
        ]
        token_lens = torch.tensor(key_lens, dtype=torch.long, device=dev) if AttentionKind.PER_TOKEN in kinds else None
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.long, device=dev)
        qsl_t = torch.tensor(qsl, dtype=torch.long, device=dev)
        key_mask_t = None if key_masks is None else torch.tensor(key_masks, dtype=torch.long, device=dev)
        metas = []
        for g, (grp, kind) in enumerate(zip(self.groups, kinds)):
            tables = [s.tables()[g] for s in batch]
            per_token = kind is AttentionKind.PER_TOKEN
            slot_mapping, block_tables, token_tables = self._table_tensors(batch, tables, num_decodes, per_token)
            key_start = None
            if grp.sliding_window is not None:
                w = grp.sliding_window
                key_start = torch.tensor([max(0, p + 1 - w) for p in positions], dtype=torch.long, device=dev)
            decode_mask = None  # only the reference decode attention reads it; the decode loop never does
            if num_decodes and (self.decode_loop is None or token_tables is None) and key_start is None:
                nb = -(-max_dec // self.block_size)
                ar = torch.arange(nb * self.block_size)
                decode_mask = (ar[None, :] < torch.tensor(seq_lens[:num_decodes])[:, None])[:, None, None, :].to(dev)
            metas.append(
                AttentionMetadata(
                    num_decodes=num_decodes,
                    num_prefills=len(batch) - num_decodes,
                    slot_mapping=slot_mapping,
                    block_tables=block_tables,
                    seq_lens=seq_lens_t,
                    query_start_loc=qsl_t,
                    seq_lens_cpu=seq_lens,
                    query_start_loc_cpu=qsl,
                    max_decode_seq_len=max_dec,
                    decode_mask=decode_mask,
                    token_block_tables=token_tables,
                    token_seq_lens=token_lens if per_token else None,
                    token_key_mask=key_mask_t,
                    key_start=key_start,
                    plan=kind,
                )
            )
        return StepInputs(
            metas[0],
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sampling,
            metas[1:],
        )

    def _table_tensors(
        self, batch: list[StepTokens], tables: list[list[int]], num_decodes: int, per_token: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One KV-cache group's slot_mapping [num_tokens], block tables [num_reqs, max_blocks] (padded with
        block 0) and, for a PER_TOKEN plan, per-token tables [num_tokens, max_blocks]."""
        bs = self.block_size
        slots: list[int] = []
        for s, bids in zip(batch, tables):
            slots.extend(bids[p // bs] * bs + p % bs for p in range(s.start_pos, s.start_pos + s.num_new_tokens))
        max_blocks = max([1, *map(len, tables)])
        flat: list[int] = []  # one tensor from one list: 64 rows cost one call, not 64
        for bids in tables:
            flat.extend(bids)
            flat.extend([0] * (max_blocks - len(bids)))
        block_tables = torch.tensor(flat, dtype=torch.long).view(len(batch), max_blocks)
        dev = self.device
        token_tables = None
        if per_token:
            if num_decodes == len(batch):  # one token each: the tables as they are
                token_tables = block_tables.to(dev)
            else:
                req_of_token = torch.repeat_interleave(
                    torch.arange(len(batch)), torch.tensor([s.num_new_tokens for s in batch])
                )
                token_tables = block_tables.index_select(0, req_of_token).to(dev)
        return torch.tensor(slots, dtype=torch.long, device=dev), block_tables.to(dev), token_tables

    def sampling_metadata(self, reqs: Sequence[SamplingRow]) -> SamplingMetadata:
        """Per-row sampling tensors for `reqs` (layers/sampler.py's sampling_metadata), with this runner's
        per-request generators."""
        return sampling_metadata(reqs, self.vocab_size, self.device, self.generators, self.sample_stream)
