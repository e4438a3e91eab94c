"""The C++ paged decode-attention kernel against the reference PyTorch path (gather + SDPA)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.attention import cpu_kernels
from tokenmill.attention.backend import TorchPagedAttention
from tokenmill.attention.metadata import AttentionMetadata

pytestmark = pytest.mark.usefixtures("each_isa")  # the generic C++ paths too


def make_decode_meta(seq_lens: list[int], num_blocks: int, block_size: int, gen: torch.Generator):
    """Random, non-contiguous block tables for decodes only (one query token each)."""
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.long)
    used = 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    mask = (torch.arange(max_blocks * block_size)[None, :] < torch.tensor(seq_lens)[:, None])[:, None, None, :]
    return AttentionMetadata(
        num_decodes=len(seq_lens),
        num_prefills=0,
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.long),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=torch.arange(len(seq_lens) + 1),
        seq_lens_cpu=list(seq_lens),
        query_start_loc_cpu=list(range(len(seq_lens) + 1)),
        max_decode_seq_len=max(seq_lens),
        decode_mask=mask,
    )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
@pytest.mark.parametrize("seq_lens", [[1], [5, 17, 16, 33], [300] + list(range(1, 40, 3))])
def test_paged_decode_matches_reference(dtype, tol, num_heads, num_kv_heads, head_dim, seq_lens, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    block_size, num_blocks = 16, 64
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    meta = make_decode_meta(seq_lens, num_blocks, block_size, gen)
    scale = head_dim**-0.5
    fast = cpu_kernels.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, scale)
    assert fast is not None and fast.shape == q.shape and fast.dtype == dtype
    monkeypatch.setattr("tokenmill.attention.backend.paged_decode_attention", lambda *a, **k: None)
    ref = TorchPagedAttention()._decode(q, cache, meta, scale)
    torch.testing.assert_close(fast.float(), ref.float(), atol=tol, rtol=tol)


# the loop each instruction-set level must choose for a 64- or 128-wide head (fp32, bf16)
VECTOR_LOOP = {
    "generic": ("generic", "generic"),
    "avx2": ("avx2", "avx2"),
    "avx512": ("avx512", "avx512"),
    "avx512_bf16": ("avx512", "avx512_bf16"),
    "amx": ("avx512", "avx512_bf16"),
}


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_runs_the_vector_loop_of_the_level_in_force(each_isa, head_dim):
    """A dispatcher that falls back to the generic loop cannot pass: the level's loop is named."""
    for dtype, want in zip((torch.float32, torch.bfloat16), VECTOR_LOOP[each_isa]):
        q, cache = torch.zeros(2, 9, head_dim, dtype=dtype), torch.zeros(2, 4, 16, 3, head_dim, dtype=dtype)
        assert cpu_kernels.decode_kernel(q, cache) == want
        assert cpu_kernels.decode_kernel(q, cache, windowed=True) == "generic"  # no window start in the vector loops
    assert cpu_kernels.decode_kernel(torch.zeros(1, 4, 32), torch.zeros(2, 4, 16, 4, 32)) == "generic"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_request_gets_the_same_bits_alone_or_in_a_batch(dtype):
    gen = torch.Generator().manual_seed(1)
    seq_lens = [300, 5, 77, 16, 129]
    cache = torch.randn(2, 64, 16, 3, 64, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), 9, 64, generator=gen).to(dtype)
    meta = make_decode_meta(seq_lens, 64, 16, gen)
    batch = cpu_kernels.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 0.125)
    for i in range(len(seq_lens)):
        alone = cpu_kernels.paged_decode_attention(
            q[i : i + 1], cache, meta.block_tables[i : i + 1], meta.seq_lens[i : i + 1], 0.125
        )
        assert torch.equal(alone[0], batch[i]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_keys_give_the_bits_of_a_decode_without_them(dtype):
    """Token trees: a node's hidden keys (bit j hides key L-1-j) leave the bits a plain decode over the
    remaining keys gives, what makes an accepted node's K/V equal to decoding's."""
    gen = torch.Generator().manual_seed(2)
    L, bs = 100, 16
    hidden_bits = (2, 3, 7, 40)
    cache = torch.randn(2, 8, bs, 3, 64, generator=gen).to(dtype)
    q = torch.randn(1, 9, 64, generator=gen).to(dtype)
    table = torch.arange(8)[None, :]
    mask = torch.tensor([sum(1 << j for j in hidden_bits)])
    masked = cpu_kernels.paged_decode_attention(q, cache, table, torch.tensor([L]), 0.125, key_mask=mask)
    kept = [t for t in range(L) if (L - 1 - t) not in hidden_bits]
    flat = cache.reshape(2, 8 * bs, 3, 64)
    compact = torch.zeros_like(flat)
    compact[:, : len(kept)] = flat[:, kept]
    plain = cpu_kernels.paged_decode_attention(q, compact.reshape(cache.shape), table, torch.tensor([len(kept)]), 0.125)
    assert torch.equal(masked, plain)


def test_kernel_declines_what_it_does_not_serve():
    q = torch.randn(1, 4, 16)
    cache = torch.zeros(2, 2, 4, 2, 16, dtype=torch.int8)
    tables, seq = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    assert cpu_kernels.paged_decode_attention(q, cache, tables, seq, 0.25) is None  # int8 cache
    assert cpu_kernels.paged_decode_attention(q.half(), cache.half(), tables, seq, 0.25) is None  # fp16


def test_kernel_refuses_a_block_size_that_is_not_a_power_of_two():
    """The kernels find a key's block and row by shift and mask (csrc/attention.cpp, BlockGeometry); a cache
    whose blocks hold 12 tokens is refused with a message, not read at the wrong rows."""
    q = torch.randn(1, 4, 64)
    cache = torch.zeros(2, 2, 12, 2, 64)
    tables, seq = torch.zeros(1, 2, dtype=torch.long), torch.full((1,), 20, dtype=torch.long)
    with pytest.raises(RuntimeError, match="power of two"):
        cpu_kernels.paged_decode_attention(q, cache, tables, seq, 0.125)


def _causal_reference(q, cache, tables, seq_lens, q_start, q_len, scale):
    """Float32 attention written out: each sequence's query rows are its last q_len positions."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    bs = cache.shape[2]
    for s in range(len(seq_lens)):
        L, n, a = int(seq_lens[s]), int(q_len[s]), int(q_start[s])
        nb = -(-L // bs)
        k = cache[0][tables[s, :nb]].flatten(0, 1)[:L].float()
        v = cache[1][tables[s, :nb]].flatten(0, 1)[:L].float()
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        scores = torch.einsum("thd,lhd->htl", q[a : a + n].float(), k) * scale
        visible = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
        out[a : a + n] = torch.einsum("htl,lhd->thd", scores.masked_fill(~visible[None], float("-inf")).softmax(-1), v)
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
def test_tiled_prefill_matches_reference(num_heads, num_kv_heads, head_dim, each_isa):
    gen = torch.Generator().manual_seed(1)
    block_size, num_blocks = 16, 80
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).bfloat16()
    # whole prompts, chunks after cached context (300 keys, the last 100 new), a single token,
    # lengths on and off the 16-key and 64-key tile edges
    seq_lens, q_len = [37, 300, 16, 1, 129, 64], [37, 100, 5, 1, 64, 64]
    tables = torch.zeros(len(seq_lens), 20, dtype=torch.long)
    perm, used = torch.randperm(num_blocks, generator=gen), 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    # query rows strided (a view of a packed qkv tensor), 3 leading rows the kernel must not touch
    total = 3 + sum(q_len)
    q = torch.randn(total, num_heads + 2 * num_kv_heads, head_dim, generator=gen).bfloat16()[:, :num_heads]
    q_start = torch.tensor([3 + sum(q_len[:i]) for i in range(len(q_len))])
    args = (tables, torch.tensor(seq_lens), q_start, torch.tensor(q_len), head_dim**-0.5)
    out = torch.full((total, num_heads, head_dim), 7.0, dtype=torch.bfloat16)
    got = cpu_kernels.paged_prefill_attention(q, cache, *args, out=out)
    if each_isa not in ("avx512_bf16", "amx"):  # the kernel needs AVX512-BF16: it declines, writing nothing
        assert got is None and bool((out == 7.0).all())
        return
    ref = _causal_reference(q, cache, *args)
    torch.testing.assert_close(got[3:].float(), ref[3:], atol=2e-2, rtol=2e-2)
    assert bool((got[:3] == 7.0).all())


def test_tiled_prefill_declines_fp32():
    cache = torch.zeros(2, 2, 16, 1, 64)
    one = torch.ones(1, dtype=torch.long)
    assert (
        cpu_kernels.paged_prefill_attention(
            torch.zeros(1, 1, 64),
            cache,
            torch.zeros(1, 1, dtype=torch.long),
            one,
            torch.zeros(1, dtype=torch.long),
            one,
            0.125,
        )
        is None
    )
