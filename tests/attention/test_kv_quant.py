"""int8 KV cache packing and the block copy op."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import read_kv, write_kv
from tokenmill.attention.kv_quant import dequantize_kv, quantize_kv
from tokenmill.core.kv_cache_manager import BlockCopy
from tokenmill.worker.kv_cache_ops import copy_blocks


def test_roundtrip_error_is_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]  # [T, H, D], wide range of scales
    packed = quantize_kv(x)
    assert packed.dtype == torch.int8 and packed.shape == (50, 3, 66)
    y = dequantize_kv(packed, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((y - x).abs() <= step * 0.5 + step * 2e-3).all()
    assert dequantize_kv(quantize_kv(torch.zeros(2, 1, 8)), torch.float32).abs().max() == 0


def test_int8_cache_write_read_and_block_copy():
    torch.manual_seed(0)
    nb, bs, h, d = 6, 4, 2, 16
    ref = torch.zeros(2, nb, bs, h, d)
    q8 = torch.zeros(2, nb, bs, h, d + 2, dtype=torch.int8)
    k, v = torch.randn(10, h, d), torch.randn(10, h, d)
    slots = torch.tensor([4 * 2 + i for i in range(4)] + [4 * 5 + i for i in range(4)] + [4, 5])  # blocks 2, 5, 1
    write_kv(ref, k, v, slots)
    write_kv(q8, k, v, slots)
    blocks = torch.tensor([2, 5, 1])
    kr, vr = read_kv(ref, blocks, 10)
    kq, vq = read_kv(q8, blocks, 10, torch.float32)
    assert torch.allclose(kr, kq, atol=0.03) and torch.allclose(vr, vq, atol=0.03)
    copy_blocks([q8, ref], [BlockCopy(1, 3), BlockCopy(5, 0)])
    kq2, _ = read_kv(q8, torch.tensor([2, 0, 3]), 10, torch.float32)
    assert torch.equal(kq2, kq)
    assert torch.equal(read_kv(ref, torch.tensor([2, 0, 3]), 10)[1], vr)
