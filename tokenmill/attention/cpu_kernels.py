"""A small C++ kernel for decode attention over paged KV blocks on CPU.

Why: the reference decode path gathers every decode's blocks into a contiguous
[B, max_len, Hkv, D] copy (written, then read again by SDPA), and CPU SDPA with a mask is
slow for 3-row queries. This kernel reads each request's K and V once, straight from the
blocks, with one task per (request, KV head) on torch's intra-op thread pool:

    for each (b, h) in parallel:                 h: KV head; its G = Hq / Hkv query heads
        s[g, t] = scale * <q[b, h*G + g], K[block_tables[b, t // bs], t % bs, h]>   t < seq_lens[b]
        p[g, :] = softmax(s[g, :])               (float32)
        out[b, h*G + g] = sum_t p[g, t] * V[...same slot..., h]

The kernels are csrc/attention.cpp, built at install (tokenmill/native.py). Without them,
`paged_decode_attention` returns None and callers keep the pure PyTorch path.
Covered by an exact-oracle test against the reference path (tests/attention).
"""

from __future__ import annotations

import torch

from tokenmill import native


def _load():
    """torch.ops.tokenmill (csrc/attention.cpp), or None without the C++ kernels."""
    return native.ops()


def is_available() -> bool:
    return native.available()


def decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, windowed: bool = False) -> str | None:
    """Which C++ loop paged_decode_attention runs for q [B, Hq, D] against kv_cache [2, nb, bs, Hkv, D] at the
    instruction-set level in force: "generic", "avx2", "avx512" or "avx512_bf16"; None without the kernels.
    windowed: with key_start (sliding windows take the generic loop)."""
    mod = native.module()
    return None if mod is None else mod.decode_kernel(q, kv_cache[0], windowed)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None = None,
    key_start: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """q [B, Hq, D]; kv_cache [2, num_blocks, bs, Hkv, D]; block_tables [B, nb] int64; seq_lens [B]
    int64 -> [B, Hq, D], or None when the kernel cannot serve this call (caller falls back).
    key_mask [B] int64 (token trees): bit j hides key seq_lens[b] - 1 - j from row b.
    key_start [B] int64 (sliding windows): row b sees keys [key_start[b], seq_lens[b]) only."""
    if (
        q.device.type != "cpu"
        or q.dtype not in (torch.float32, torch.bfloat16)
        or kv_cache.dtype != q.dtype
        or kv_cache.shape[-1] != q.shape[-1]
    ):
        return None
    mod = _load()
    if mod is None:
        return None
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    out = q.new_empty(q.shape)
    mod.paged_decode(
        out,
        q,
        kv_cache[0],
        kv_cache[1],
        block_tables.contiguous(),
        seq_lens.contiguous(),
        scale,
        None if key_mask is None else key_mask.contiguous(),
        None if key_start is None else key_start.contiguous(),
    )
    return out


def write_and_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    key_start: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A decode-only step in one call: write k, v [B, Hkv, D] at slot_mapping [B], then attend as
    `paged_decode_attention`. None (nothing written) when the kernel cannot serve the call."""
    if (
        q.device.type != "cpu"
        or q.dtype not in (torch.float32, torch.bfloat16)
        or kv_cache.dtype != q.dtype
        or k.dtype != q.dtype
        or v.dtype != q.dtype
        or kv_cache.shape[-1] != q.shape[-1]
        or any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (q, k, v))
        or not (block_tables.is_contiguous() and seq_lens.is_contiguous() and slot_mapping.is_contiguous())
    ):
        return None
    mod = _load()
    if mod is None:
        return None
    out = q.new_empty(q.shape)
    mod.write_and_decode(
        out,
        q,
        k,
        v,
        slot_mapping,
        kv_cache[0],
        kv_cache[1],
        block_tables,
        seq_lens,
        scale,
        None,
        None if key_start is None else key_start.contiguous(),
    )
    return out


def tiled_prefill_serves(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `paged_prefill_attention` serves a CPU model of this dtype and head_dim (csrc/attention.cpp,
    paged_prefill: bf16 caches, head_dim 64 or 128, an AVX512-BF16 CPU)."""
    return dtype == torch.bfloat16 and head_dim in (64, 128) and native.has_avx512_bf16()


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Tiled prefill attention (bf16 cache, head_dim 64 or 128, AVX512-BF16 CPUs): for each sequence
    s, the q_len[s] query rows starting at q_start[s] are the last positions of its seq_lens[s] keys
    (causal). q [T, Hq, D]; block_tables [S, nb]; the three others [S] int64. Writes those rows of
    `out` ([T, Hq, D], allocated when None) and returns it; None (nothing written) when the kernel
    does not serve the call."""
    if (
        q.device.type != "cpu"
        or q.dtype != torch.bfloat16
        or kv_cache.dtype != torch.bfloat16
        or kv_cache.shape[-1] != q.shape[-1]
        or q.stride(2) != 1
        or q.stride(1) != q.shape[2]
    ):
        return None
    mod = _load()
    if mod is None:
        return None
    if out is None:
        out = q.new_empty(q.shape)
    ok = mod.paged_prefill(
        out,
        q,
        kv_cache[0],
        kv_cache[1],
        block_tables.contiguous(),
        seq_lens.contiguous(),
        q_start.contiguous(),
        q_len.contiguous(),
        scale,
    )
    return out if ok else None
