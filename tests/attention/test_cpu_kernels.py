"""The C++ paged decode-attention kernel against the reference PyTorch path (gather + SDPA)."""
from __future__ import annotations

import pytest
import torch

from tokenmill.attention import cpu_kernels
from tokenmill.attention.backend import TorchPagedAttention
from tokenmill.attention.metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(not cpu_kernels.is_available(), reason="C++ kernel could not be built here")


def make_decode_meta(seq_lens: list[int], num_blocks: int, block_size: int, gen: torch.Generator):
    """Random, non-contiguous block tables for decodes only (one query token each)."""
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.long)
    used = 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    mask = (torch.arange(max_blocks * block_size)[None, :] < torch.tensor(seq_lens)[:, None])[:, None, None, :]
    return AttentionMetadata(
        num_decodes=len(seq_lens), num_prefills=0, slot_mapping=torch.zeros(len(seq_lens), dtype=torch.long),
        block_tables=tables, seq_lens=torch.tensor(seq_lens), query_start_loc=torch.arange(len(seq_lens) + 1),
        seq_lens_cpu=list(seq_lens), query_start_loc_cpu=list(range(len(seq_lens) + 1)),
        max_decode_seq_len=max(seq_lens), decode_mask=mask)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
@pytest.mark.parametrize("seq_lens", [[1], [5, 17, 16, 33], [300] + list(range(1, 40, 3))])
def test_paged_decode_matches_reference(dtype, tol, num_heads, num_kv_heads, head_dim, seq_lens, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    block_size, num_blocks = 16, 64
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    meta = make_decode_meta(seq_lens, num_blocks, block_size, gen)
    scale = head_dim ** -0.5
    fast = cpu_kernels.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, scale)
    assert fast is not None and fast.shape == q.shape and fast.dtype == dtype
    monkeypatch.setattr("tokenmill.attention.backend.paged_decode_attention", lambda *a, **k: None)
    ref = TorchPagedAttention()._decode(q, cache, meta, scale)
    torch.testing.assert_close(fast.float(), ref.float(), atol=tol, rtol=tol)


def test_kernel_declines_what_it_does_not_serve():
    q = torch.randn(1, 4, 16)
    cache = torch.zeros(2, 2, 4, 2, 16, dtype=torch.int8)
    tables, seq = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    assert cpu_kernels.paged_decode_attention(q, cache, tables, seq, 0.25) is None          # int8 cache
    assert cpu_kernels.paged_decode_attention(q.half(), cache.half(), tables, seq, 0.25) is None  # fp16
