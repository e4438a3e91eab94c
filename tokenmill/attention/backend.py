"""Attention backends. `TorchPagedAttention` is the reference: pure PyTorch, CPU and CUDA.

Paged KV cache layout, one tensor per layer:

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
               ^K/V  ^physical block  ^slot within block

A token at slot s lives at kv_cache[:, s // block_size, s % block_size].
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from tokenmill.attention import metadata as attention_metadata
from tokenmill.attention.cpu_kernels import paged_decode_attention, paged_prefill_attention, write_and_decode
from tokenmill.attention.kv_quant import dequantize_kv, is_quantized, write_kv_int8
from tokenmill.attention.metadata import AttentionKind, AttentionMetadata, PerTokenTables, ShortRows, TiledPlan


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata | None,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """sliding_window: the layer's window (a query at p sees keys (p - W, p]). With a paged cache the
        window arrives as meta.key_start (its group's metadata); without one, dense attention applies it."""
        ...


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """No cache: q [..., T, Hq, D], k/v [..., T, Hkv, D] -> [..., T, Hq, D], causal (and windowed)."""
    if q.dim() == 3:  # NOTE: 3-D inputs take SDPA's math path on CPU; a batch dim selects flash (~5x at T=2048)
        return dense_causal_attention(q[None], k[None], v[None], scale, sliding_window)[0]
    qt, kt, vt = q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)
    T = q.shape[-3]
    if sliding_window is not None and T > sliding_window:
        i = torch.arange(T, device=q.device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=q.shape[-2] != k.shape[-2]
        )
    else:
        out = F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=q.shape[-2] != k.shape[-2]
        )
    return out.transpose(-3, -2)


class TorchPagedAttention:
    """Writes new K/V into their slots, then attends over each request's blocks.

    On CPU (fp32/bf16 cache) the C++ kernels serve the step: long prompt chunks tiled (bf16), every
    other token as a decode over its own prefix. Otherwise decodes are batched: their blocks are gathered into
    [num_decodes, max_len] and masked by length. Prefill chunks run one request at a time with a
    causal mask offset by the request's cached context (a chunk at positions [c, c + n) sees keys
    [0, c + n)).

    Which of the two each step takes is the runner's attention plan (metadata.plan_attention, on
    AttentionMetadata.plan):
    TILED sends prompt chunks of TILED_PREFILL_MIN_TOKENS or more to the tiled kernel (3-4x faster prompt
    attention); PER_TOKEN (ModelConfig.attends_prompts_per_token) attends every token as a decode over its own
    prefix, so its bits do not depend on how its prompt was chunked or batched.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata | None,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        # q: [num_tokens, Hq, D]; k, v: [num_tokens, Hkv, D]
        if meta is None or kv_cache is None:
            return dense_causal_attention(q, k, v, scale, sliding_window)
        if sliding_window is not None and meta.key_start is None:
            raise ValueError("a sliding-window layer got metadata without key_start (not its KV group's)")
        if meta.num_prefills == 0 and meta.custom_mask is None:  # decode-only step: one C++ call when possible
            out = write_and_decode(
                q, k, v, meta.slot_mapping, kv_cache, meta.block_tables, meta.seq_lens, scale, meta.key_start
            )
            if out is not None:
                return out
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if meta.custom_mask is None:  # CPU: the C++ kernels, one or two calls per layer
            out = _cpu_kernel_attention(q, kv_cache, meta, scale)
            if out is not None:
                return out
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale)
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        block_size = kv_cache.shape[2]
        for i in range(nd, nd + meta.num_prefills):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            n = end - start
            if seq_len == n and meta.custom_mask is None:
                # Whole prompt in this step: its own K/V are all there is.
                out[start:end] = dense_causal_attention(q[start:end], k[start:end], v[start:end], scale, sliding_window)
                continue
            num_blocks = (seq_len + block_size - 1) // block_size
            blocks = meta.block_tables[i, :num_blocks]
            kc, vc = read_kv(kv_cache, blocks, seq_len, q.dtype)  # [seq_len, Hkv, D]
            if meta.custom_mask is not None:
                mask = meta.custom_mask[start:end, :seq_len]
            else:
                q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, seq_len]
                if meta.key_start is not None:
                    mask &= torch.arange(seq_len, device=q.device)[None, :] >= meta.key_start[start:end, None]
                if meta.token_key_mask is not None:
                    mask &= ~_hidden_keys(meta.token_key_mask[start:end], q_pos, seq_len)
            qt = q[start:end].transpose(0, 1)[None]  # [1, Hq, n, D] (4-D: the flash path on CPU)
            o = F.scaled_dot_product_attention(
                qt,
                kc.transpose(0, 1)[None],
                vc.transpose(0, 1)[None],
                attn_mask=mask,
                scale=scale,
                enable_gqa=qt.shape[1] != kc.shape[1],
            )
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [B, Hq, D] -> grouped as [B, Hkv, G, D] so one K/V head serves its G query heads
        # without materializing repeated keys.
        nd = meta.num_decodes
        # Fast path (CPU, fp32/bf16 cache): a C++ kernel reading K/V straight from the blocks.
        ks = None if meta.key_start is None else meta.key_start[:nd]
        fast = paged_decode_attention(q, kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, key_start=ks)
        if fast is not None:
            return fast
        block_size = kv_cache.shape[2]
        max_blocks = (meta.max_decode_seq_len + block_size - 1) // block_size
        tables = meta.block_tables[:nd, :max_blocks]  # [B, nb]
        kc = kv_cache[0][tables].flatten(1, 2)  # [B, nb * bs, Hkv, D]
        vc = kv_cache[1][tables].flatten(1, 2)
        if is_quantized(kv_cache):
            kc, vc = dequantize_kv(kc, q.dtype), dequantize_kv(vc, q.dtype)
        b, hq, d = q.shape
        hkv = kc.shape[2]
        qg = q.view(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]
        mask = meta.decode_mask
        if mask is None or ks is not None:  # (the runner skips it when its decode loop serves decode steps)
            ar = torch.arange(kc.shape[1], device=q.device)[None, :]
            mask = ar < meta.seq_lens[:nd, None]
            if ks is not None:
                mask &= ar >= ks[:, None]
            mask = mask[:, None, None, :]
        o = F.scaled_dot_product_attention(qg, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask, scale=scale)
        return o.reshape(b, hq, d)


def _cpu_kernel_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor | None:
    """The step's attention by the C++ kernels (None when they do not serve it): long prompt chunks
    tiled (cpu_kernels.paged_prefill_attention, bf16), the other tokens each as a decode over its
    own prefix (paged_decode_attention). On the 64-request offline benchmark (bf16) prefill
    attention took 1.74 s as one SDPA call per request, 1.53 s token by token, and ~0.45 s tiled."""
    plan = tiled_plan(meta)
    if plan is not None:
        out = paged_prefill_attention(q, kv_cache, plan.block_tables, plan.seq_lens, plan.q_start, plan.q_len, scale)
        if out is not None:
            if plan.short is None:
                return out
            short_idx, short = plan.short.index, plan.short.tables
            o = paged_decode_attention(
                q.index_select(0, short_idx), kv_cache, short.block_tables, short.seq_lens, scale, short.key_mask
            )
            if o is not None:
                out.index_copy_(0, short_idx, o)
                return out
    tables = _per_token_tables(meta)
    return paged_decode_attention(
        q, kv_cache, tables.block_tables, tables.seq_lens, scale, tables.key_mask, meta.key_start
    )


def _hidden_keys(key_mask: torch.Tensor, q_pos: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[n, seq_len] True where a token tree hides key (q_pos - j) from a row whose key_mask has bit j
    (the reference path's form of the kernels' key mask)."""
    j = q_pos[:, None] - torch.arange(seq_len, device=q_pos.device)[None, :]  # keys before the row
    bit = ((key_mask[:, None] >> j.clamp(0, 63)) & 1).bool()
    return bit & (j > 0) & (j < 64)


def tiled_plan(meta: AttentionMetadata) -> TiledPlan | None:
    """A TILED step's split (attention/metadata.py): the long requests (prompt chunks of TILED_PREFILL_MIN_TOKENS or
    more) for the tiled kernel, the other tokens per token; None for a PER_TOKEN step. Built once per step
    (meta.derived)."""
    derived = meta.derived
    if derived.tiled_done:
        return derived.tiled
    plan = None
    if meta.plan is AttentionKind.TILED:
        min_tokens = attention_metadata.TILED_PREFILL_MIN_TOKENS
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        counts = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
        long = [i for i, n in enumerate(counts) if n >= min_tokens]
        if long:
            dev = meta.block_tables.device
            sel = torch.tensor(long, device=dev)
            short = [i for i, n in enumerate(counts) if n < min_tokens]
            short_part = None
            if short:
                idx = [t for i in short for t in range(qsl[i], qsl[i + 1])]
                req = torch.tensor([i for i in short for _ in range(counts[i])], device=dev)
                short_idx = torch.tensor(idx, device=dev)
                short_part = ShortRows(
                    short_idx,
                    PerTokenTables(
                        meta.block_tables.index_select(0, req).contiguous(),
                        torch.tensor(
                            [lens[i] - counts[i] + 1 + j for i in short for j in range(counts[i])], device=dev
                        ),
                        None if meta.token_key_mask is None else meta.token_key_mask.index_select(0, short_idx),
                    ),
                )
            plan = TiledPlan(
                meta.block_tables.index_select(0, sel),
                meta.seq_lens.index_select(0, sel),
                torch.tensor([qsl[i] for i in long], device=dev),
                torch.tensor([counts[i] for i in long], device=dev),
                short_part,
            )
    derived.tiled, derived.tiled_done = plan, True
    return plan


def _per_token_tables(meta: AttentionMetadata) -> PerTokenTables:
    """[num_tokens, max_blocks] block tables and [num_tokens] causal key counts: token j of a request
    whose chunk ends at seq_len sees keys [0, seq_len - n + j + 1). Built once per step (meta.derived)
    for the C++ kernel, which then serves prefill chunks and decodes in one call per layer.
    On the 64-request offline benchmark (bf16) prefill attention took 1.74 s as one SDPA call per
    request and 1.53 s this way. A side effect: a query row's attention no longer depends on how
    its prompt was chunked."""
    derived = meta.derived
    if derived.per_token is not None:
        return derived.per_token
    if meta.token_block_tables is not None and meta.token_seq_lens is not None:
        tables = PerTokenTables(meta.token_block_tables, meta.token_seq_lens, meta.token_key_mask)
    else:
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        counts = torch.tensor([qsl[i + 1] - qsl[i] for i in range(len(lens))])
        bt = meta.block_tables.repeat_interleave(counts.to(meta.block_tables.device), dim=0)
        seq = torch.cat([torch.arange(lens[i] - int(counts[i]) + 1, lens[i] + 1) for i in range(len(lens))])
        tables = PerTokenTables(bt.contiguous(), seq.to(meta.block_tables.device), meta.token_key_mask)
    derived.per_token = tables
    return tables


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache [2, nb, bs, H, D]; k, v [T, H, D]; slot_mapping [T]."""
    if is_quantized(kv_cache):
        return write_kv_int8(kv_cache, k, v, slot_mapping)
    flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def read_kv(
    kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather one request's first seq_len keys and values: each [seq_len, H, D] (an int8 cache is
    dequantized to dtype)."""
    k = kv_cache[0][blocks].flatten(0, 1)[:seq_len]
    v = kv_cache[1][blocks].flatten(0, 1)[:seq_len]
    if is_quantized(kv_cache):
        k, v = dequantize_kv(k, dtype or torch.float32), dequantize_kv(v, dtype or torch.float32)
    return k, v
