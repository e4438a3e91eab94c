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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tokenmill.attention.kv_quant import cache_head_dim
from tokenmill.attention.metadata import AttentionMetadata, forward_context
from tokenmill.config import ModelArchConfig
from tokenmill.core.scheduler import SamplerResult, ScheduledRequest, SchedulerOutput
from tokenmill.layers.sampler import Sampler, SamplingMetadata
from tokenmill.worker import cpu_decode
from tokenmill.worker.kv_cache_ops import add_forked_samples, copy_blocks


@dataclass
class KVCacheSpec:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def cache_head_dim(self) -> int:
        """Last dim of the cache tensor: head_dim, plus the packed scale for int8 (kv_quant.py)."""
        return cache_head_dim(self.head_dim, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.cache_head_dim * elem


MAX_TOKENS_AS_DECODES = 9
"""Steps where no request has more new tokens than this (decodes; verification of up to 8 drafts)
also get per-token attention metadata, so the CPU decode loop can serve them."""


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch: ModelArchConfig, kv_spec: KVCacheSpec,
                 device: torch.device, seed: int = 0) -> None:
        self.model = model  # weights already processed for their kernels (load_model)
        self.arch = arch
        self.kv_spec = kv_spec
        self.device = device
        self.block_size = kv_spec.block_size
        self.vocab_size = arch.vocab_size
        # [num_layers] x [2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_caches = [torch.zeros(2, kv_spec.num_blocks, kv_spec.block_size, kv_spec.num_kv_heads,
                                      kv_spec.cache_head_dim, dtype=kv_spec.dtype, device=device)
                          for _ in range(kv_spec.num_layers)]
        for attn, cache in zip(model.attention_layers(), self.kv_caches):
            attn.kv_cache = cache
        # Steps of a few tokens per request on CPU: the C++ layer loop (worker/cpu_decode.py), or None.
        self.decode_loop = cpu_decode.build(model.decoder_layout(), self.kv_caches) if device.type == "cpu" else None
        self.sampler = Sampler(seed, device=str(device))
        self.generators: dict[str, torch.Generator] = {}
        self.spec_verifier: Callable[..., dict[str, SamplerResult]] | None = None
        """Set by the engine when speculating: (logits, sampling, meta, global_gen) -> results for a
        batch where some requests carry drafts (spec_decode/rejection_sampler.py)."""
        self.hidden_sink: Callable[[list[ScheduledRequest], torch.Tensor], None] | None = None
        """Set by a proposer that drafts from the target's features (EAGLE): called every step with
        the batch (in input order) and the final hidden states [num_tokens, hidden] of all its tokens."""

    # ----------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> dict[str, SamplerResult]:
        for rid in sched.finished_ids:
            self.generators.pop(rid, None)
        if sched.block_copies:
            copy_blocks(self.kv_caches, sched.block_copies)
        if sched.is_empty:
            return {}
        batch = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)  # decodes first (stable)
        meta, input_ids, positions, logits_indices, sampling = self._prepare(batch)
        if sched.forked:
            logits_indices, sampling = add_forked_samples(sched.forked, logits_indices, sampling)
        if self.decode_loop is not None and self.decode_loop.serves(meta, input_ids.shape[0]):
            hidden = self.decode_loop(input_ids, positions, meta)
        else:
            with forward_context(meta):
                hidden = self.model(input_ids, positions)  # [num_tokens, hidden]
        if self.hidden_sink is not None:
            self.hidden_sink(batch, hidden)
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[logits_indices])  # [num_sampling, vocab]
        reqs = [s.request for s in sampling]
        smeta = self._sampling_metadata(sampling)
        if self.spec_verifier is not None and any(s.num_spec_tokens for s in sampling):
            return self.spec_verifier(logits, sampling, smeta, self.sampler.global_gen)
        out = self.sampler(logits, smeta, [r.sampling_params.logprobs for r in reqs])
        tokens = out.token_ids.tolist()
        return {r.request_id: SamplerResult([tokens[i]], None if out.logprobs is None or out.logprobs[i] is None
                                            else [out.logprobs[i]]) for i, r in enumerate(reqs)}

    def _prepare(self, batch: list[ScheduledRequest]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling: list[ScheduledRequest] = []
        max_blocks = 1
        for s in batch:
            n, start = s.num_new_tokens, s.start_pos
            input_ids.extend(s.token_ids)
            pos = range(start, start + n)
            positions.extend(pos)
            bids = s.block_ids
            slots.extend(bids[p // bs] * bs + p % bs for p in pos)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            max_blocks = max(max_blocks, len(bids))
            if s.is_sampling:  # a request with k drafts needs logits at its last 1 + k tokens
                logits_indices.extend(range(qsl[-1] - 1 - s.num_spec_tokens, qsl[-1]))
                sampling.append(s)
        num_decodes = 0  # decodes were sorted first
        for s in batch:
            if s.num_new_tokens != 1:
                break
            num_decodes += 1
        tables = torch.zeros(len(batch), max_blocks, dtype=torch.long)
        for i, s in enumerate(batch):
            tables[i, :len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.long)
        dev = self.device
        max_dec = max(seq_lens[:num_decodes], default=0)
        token_tables = token_lens = None
        if max((s.num_new_tokens for s in batch), default=0) <= MAX_TOKENS_AS_DECODES:
            if num_decodes == len(batch):  # one token each: the tables as they are
                token_tables = tables.to(dev)
            else:
                req_of_token = torch.repeat_interleave(torch.arange(len(batch)),
                                                       torch.tensor([s.num_new_tokens for s in batch]))
                token_tables = tables.index_select(0, req_of_token).to(dev)
            token_lens = torch.tensor(positions, dtype=torch.long, device=dev) + 1
        decode_mask = None  # only the reference decode attention reads it; the decode loop never does
        if num_decodes and (self.decode_loop is None or token_tables is None):
            nb = -(-max_dec // bs)
            ar = torch.arange(nb * bs)
            decode_mask = (ar[None, :] < torch.tensor(seq_lens[:num_decodes])[:, None])[:, None, None, :].to(dev)
        meta = AttentionMetadata(
            num_decodes=num_decodes, num_prefills=len(batch) - num_decodes,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=tables.to(dev), seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.long, device=dev),
            seq_lens_cpu=seq_lens, query_start_loc_cpu=qsl, max_decode_seq_len=max_dec, decode_mask=decode_mask,
            token_block_tables=token_tables, token_seq_lens=token_lens)
        return (meta, torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                torch.tensor(logits_indices, dtype=torch.long, device=dev), sampling)

    def _sampling_metadata(self, sampling: list[ScheduledRequest]) -> SamplingMetadata:
        dev = self.device
        reqs = [s.request for s in sampling]
        params = [r.sampling_params for r in reqs]
        n, V = len(reqs), self.vocab_size
        temps = torch.tensor([0.0 if p.is_greedy else p.temperature for p in params], device=dev)
        all_greedy = all(p.is_greedy for p in params)

        def opt(values: list[float], neutral: float, dtype=torch.float32) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=dev)

        top_k = opt([p.top_k for p in params], 0, torch.long)
        top_p = opt([p.top_p for p in params], 1.0)
        min_p = opt([p.min_p for p in params], 0.0)
        pres = opt([p.presence_penalty for p in params], 0.0)
        freq = opt([p.frequency_penalty for p in params], 0.0)
        rep = opt([p.repetition_penalty for p in params], 1.0)
        counts = prompt_mask = None
        if pres is not None or freq is not None or rep is not None:
            counts = torch.zeros(n, V, device=dev)
            for i, r in enumerate(reqs):
                if r.output_token_ids:
                    ids = torch.tensor(r.output_token_ids, device=dev)
                    counts[i].scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
            if rep is not None:
                prompt_mask = torch.zeros(n, V, dtype=torch.bool, device=dev)
                for i, r in enumerate(reqs):
                    prompt_mask[i, torch.tensor(r.prompt_token_ids, device=dev)] = True
        ban = None
        for i, r in enumerate(reqs):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                if ban is None:
                    ban = torch.zeros(n, V, dtype=torch.bool, device=dev)
                ids = list(p.stop_token_ids) + ([r.eos_token_id] if r.eos_token_id is not None and not p.ignore_eos else [])
                if ids:
                    ban[i, torch.tensor(ids, device=dev)] = True
        gens: list[torch.Generator | None] = []
        for r in reqs:
            seed = r.sampling_params.seed
            if seed is None or r.sampling_params.is_greedy:
                gens.append(None)
                continue
            g = self.generators.get(r.request_id)
            if g is None:
                g = torch.Generator(device=dev)
                g.manual_seed(seed)
                self.generators[r.request_id] = g
            gens.append(g)
        nlp = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata(temps, top_k, top_p, min_p, pres, freq, rep, counts, prompt_mask, ban, gens,
                                all_greedy, max(nlp) if nlp else None)
