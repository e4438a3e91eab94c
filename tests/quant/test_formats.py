"""Pack/unpack round trips, checked against independent decoders written here from the
AutoGPTQ / AutoAWQ packing loops (not from tokenmill's vectorized code)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.quant.formats import (
    from_awq_tensors,
    from_gptq_tensors,
    pack_awq,
    pack_bitstream,
    to_awq_tensors,
    to_gptq_tensors,
    unpack_awq,
    unpack_bitstream,
)
from tokenmill.quant.grid import QuantizedWeight, quantize_groupwise


def autogptq_pack_loop(intweight: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's QuantLinear.pack loop over rows of intweight [in, out] (uint32)."""
    intweight = intweight.astype(np.uint32)
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        if bits in (2, 4, 8):
            for j in range(i, i + (32 // bits)):
                qweight[row] |= intweight[j] << (bits * (j - i))
            i += 32 // bits
            row += 1
        elif bits == 3:
            for j in range(i, i + 10):
                qweight[row] |= intweight[j] << (3 * (j - i))
            i += 10
            qweight[row] |= intweight[i] << 30
            row += 1
            qweight[row] |= (intweight[i] >> 2) & 1
            i += 1
            for j in range(i, i + 10):
                qweight[row] |= intweight[j] << (3 * (j - i) + 1)
            i += 10
            qweight[row] |= intweight[i] << 31
            row += 1
            qweight[row] |= (intweight[i] >> 1) & 0x3
            i += 1
            for j in range(i, i + 10):
                qweight[row] |= intweight[j] << (3 * (j - i) + 2)
            i += 10
            row += 1
    return qweight.astype(np.int32)


def autogptq_decode_4bit(qweight: np.ndarray) -> np.ndarray:
    """The 4-bit dequant of AutoGPTQ's torch kernel: shift each word right by 0,4,...,28."""
    w = qweight.astype(np.uint32)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    vals = (w[:, None, :] >> shifts[None, :, None]) & 15  # [in/8, 8, out]
    return vals.reshape(-1, w.shape[1])


def awq_decode(qweight: np.ndarray) -> np.ndarray:
    """AutoAWQ's unpack + reverse-order: shifts 0..28 then columns reordered by [0,4,1,5,2,6,3,7]."""
    w = qweight.astype(np.uint32)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    iw = (w[:, :, None] >> shifts[None, None, :]) & 15  # [rows, cols/8, 8]
    iw = iw.reshape(w.shape[0], -1)
    reverse = np.array([0, 4, 1, 5, 2, 6, 3, 7])
    idx = (np.arange(iw.shape[-1]).reshape(-1, 8)[:, reverse]).reshape(-1)
    return iw[:, idx]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_bitstream_matches_autogptq_loop(bits):
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 2**bits, (64, 24), generator=g)
    ours = pack_bitstream(values, bits).numpy()
    ref = autogptq_pack_loop(values.numpy(), bits)
    assert np.array_equal(ours, ref)
    assert torch.equal(unpack_bitstream(torch.from_numpy(ref), bits, 64), values)


def test_gptq_4bit_decodes_with_independent_decoder():
    values = torch.randint(0, 16, (64, 40), generator=torch.Generator().manual_seed(1))
    assert np.array_equal(autogptq_decode_4bit(pack_bitstream(values, 4).numpy()), values.numpy())


def test_awq_pack_matches_autoawq_order():
    values = torch.randint(0, 16, (16, 32), generator=torch.Generator().manual_seed(2))
    packed = pack_awq(values)
    # AutoAWQ's pack loop
    ref = np.zeros((16, 4), dtype=np.uint32)
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    for col in range(4):
        for i in range(8):
            ref[:, col] |= values[:, col * 8 + order[i]].numpy().astype(np.uint32) << (i * 4)
    assert np.array_equal(packed.numpy(), ref.astype(np.int32))
    assert np.array_equal(awq_decode(packed.numpy()), values.numpy())
    assert torch.equal(unpack_awq(packed), values)


def _random_qw(bits, out=64, cols=128, gs=32, sym=False, act_order=False, seed=0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    qw = quantize_groupwise(torch.randn(out, cols, generator=g), bits, gs, sym, min_zero=1)
    if act_order:
        qw.g_idx = qw.g_idx[torch.randperm(cols, generator=g)]
    return qw


@pytest.mark.parametrize(
    "bits,sym,act_order", [(4, True, False), (4, False, True), (3, False, False), (8, True, False), (2, False, False)]
)
def test_gptq_layer_round_trip(bits, sym, act_order):
    qw = _random_qw(bits, sym=sym, act_order=act_order)
    t = to_gptq_tensors(qw)
    assert t["qweight"].shape == (128 * bits // 32, 64) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (4, 64 * bits // 32) and t["scales"].dtype == torch.float16
    back = from_gptq_tensors(t, bits, 32, sym)
    for name in ("codes", "scales", "zeros", "g_idx"):
        assert torch.equal(getattr(back, name), getattr(qw, name)), name
    if bits == 4:
        # v1 zeros: an independent decode of qzeros gives zero - 1
        z = autogptq_decode_4bit(t["qzeros"].numpy().T)  # [out, groups]
        assert np.array_equal(z + 1, qw.zeros.numpy())
        if sym:
            assert (t["qzeros"] == 0x77777777).all()


def test_awq_layer_round_trip():
    qw = quantize_groupwise(torch.randn(64, 128), 4, 32, sym=False, fit="awq")
    t = to_awq_tensors(qw)
    assert t["qweight"].shape == (128, 8) and t["qzeros"].shape == (4, 8)
    back = from_awq_tensors(t, 32)
    for name in ("codes", "scales", "zeros", "g_idx"):
        assert torch.equal(getattr(back, name), getattr(qw, name)), name
    w_ref = (
        awq_decode(t["qweight"].numpy()).astype(np.int64)
        - awq_decode(t["qzeros"].numpy()).astype(np.int64).repeat(32, 0)
    ) * t["scales"].float().numpy().repeat(32, 0)
    assert np.allclose(w_ref.T, qw.dequantize().numpy())


def test_gptq_v1_rejects_zero_point_zero():
    qw = quantize_groupwise(torch.rand(8, 32) + 0.1, 4, 32, sym=False, min_zero=0)  # all-positive groups
    assert int(qw.zeros.min()) == 0
    with pytest.raises(ValueError, match="zero point of 0"):
        to_gptq_tensors(qw)
    assert int(quantize_groupwise(torch.rand(8, 32) + 0.1, 4, 32, sym=False, min_zero=1).zeros.min()) == 1


def test_impossible_group_size_is_clear_error():
    with pytest.raises(ValueError, match="group_size 128 does not divide the input size 576"):
        quantize_groupwise(torch.randn(4, 576), 4, 128, sym=True)
