"""Prepacked bf16 linears give exactly F.linear's values; fp32 and quantized layers are left alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.cpu_packed_linear import PackedBf16LinearMethod, packed_linear_available, prepack_bf16_linears
from tokenmill.layers.linear import Linear, UnquantizedLinearMethod

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="no oneDNN in this torch build")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1,), (3,), (64,), (2, 5)])
def test_bitwise_equal_to_f_linear(bias, shape):
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias, dtype=torch.bfloat16)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    x = torch.randn(*shape, 96).to(torch.bfloat16)
    ref = F.linear(x, layer.weight, layer.bias)
    model = torch.nn.Sequential(layer)
    assert prepack_bf16_linears(model) == 1
    assert isinstance(layer.quant_method, PackedBf16LinearMethod)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == ref.shape and torch.equal(out, ref)


def test_fp32_and_quantized_layers_untouched():
    class FakeQuant:
        def apply(self, layer, x):
            return x

    fp32 = Linear(8, 8, dtype=torch.float32)
    quant = Linear(8, 8, dtype=torch.bfloat16)
    quant.quant_method = FakeQuant()
    assert prepack_bf16_linears(torch.nn.Sequential(fp32, quant)) == 0
    assert type(fp32.quant_method) is UnquantizedLinearMethod and isinstance(quant.quant_method, FakeQuant)
