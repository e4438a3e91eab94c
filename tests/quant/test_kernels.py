"""Quantized linear layers equal the dequantized reference (QuantizedWeight.dequantize) within tolerance."""
from __future__ import annotations

import pytest
import torch

from tokenmill.layers.linear import Linear
from tokenmill.quant.grid import quantize_groupwise
from tokenmill.quant.kernels import install_quantized, tinygemm_layout_ok, tinygemm_unpack


def _layer(out, cols, dtype, bias=False):
    layer = Linear(cols, out, bias=bias, dtype=dtype)
    layer.weight.data.normal_(generator=torch.Generator().manual_seed(0))
    if bias:
        layer.bias.data.normal_()
    return layer


def test_tinygemm_layout_self_check():
    assert tinygemm_layout_ok()
    codes = torch.randint(0, 16, (192, 576), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    assert torch.equal(tinygemm_unpack(packed, 192, 576).int(), codes)


CASES = [  # bits, out, in, group, sym, act_order
    (4, 192, 576, 64, True, False),
    (4, 128, 256, 32, False, True),
    (3, 64, 128, 64, False, False),
    (4, 80, 128, 32, True, False),     # N % 64 != 0 -> plain nibble layout, dequant only
    (4, 64, 96, -1, False, False),     # per channel
    (8, 192, 576, -1, True, False),    # int8 kernel, symmetric
    (8, 192, 576, -1, False, False),   # int8 kernel + asymmetric correction
    (8, 64, 128, 32, False, False),    # grouped int8 -> dequant
]


@pytest.mark.parametrize("bits,out,cols,gs,sym,act_order", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["dequant", "kernel"])
def test_quantized_linear_matches_reference(bits, out, cols, gs, sym, act_order, dtype, path):
    layer = _layer(out, cols, dtype, bias=True)
    qw = quantize_groupwise(layer.weight.data.float(), bits, gs, sym)
    if act_order:
        qw.g_idx = qw.g_idx[torch.randperm(cols, generator=torch.Generator().manual_seed(1))]
    bias = layer.bias.data.float().clone()
    install_quantized(layer, qw)
    assert layer.weight is None
    layer.quant_method.force_path = path
    x = torch.randn(5, 3, cols, generator=torch.Generator().manual_seed(2))
    ref = torch.nn.functional.linear(x, qw.dequantize(), bias)
    y = layer(x.to(dtype)).float()
    assert y.shape == (5, 3, out)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = ref.abs().max()
    assert (y - ref).abs().max() / scale < tol


def test_int4_kernel_is_selected_for_bf16_decode():
    layer = _layer(192, 576, torch.bfloat16)
    install_quantized(layer, quantize_groupwise(layer.weight.data.float(), 4, 64, True))
    assert layer.quant_method.is_tinygemm
    assert layer.qweight.numel() == 192 * 576 // 2  # 4 bits per weight
    layer(torch.randn(1, 576, dtype=torch.bfloat16))  # runs the measurement; either path is valid
