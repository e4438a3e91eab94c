"""Quantized linear layers equal the dequantized reference (QuantizedWeight.dequantize) within tolerance."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from tests.conftest import isa_skip_reason
from tokenmill import native
from tokenmill.layers.linear import Linear
from tokenmill.native import ISA_LEVELS
from tokenmill.quant import cpu_int4
from tokenmill.quant.grid import quantize_groupwise
from tokenmill.quant.kernels import DEFAULT_PLAN, KernelPlan, install_quantized, tinygemm_layout_ok, tinygemm_unpack


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


def _decode_k64(packed: torch.Tensor) -> torch.Tensor:
    """An independent reader of the k64 layout: byte (n, 32c + j) holds codes (n, 64c + j) low and
    (n, 64c + 32 + j) high."""
    n, half = packed.shape
    out = torch.empty(n, half * 2, dtype=torch.int64)
    for b in range(half):
        c, j = divmod(b, 32)
        out[:, 64 * c + j] = packed[:, b].long() & 15
        out[:, 64 * c + 32 + j] = packed[:, b].long() >> 4
    return out


def test_k64_layout_round_trip():
    codes = torch.randint(0, 16, (24, 192), generator=torch.Generator().manual_seed(3))
    packed = cpu_int4.pack(codes)
    assert packed.shape == (24, 96) and packed.dtype == torch.uint8
    assert torch.equal(_decode_k64(packed), codes)
    assert torch.equal(cpu_int4.unpack(packed).long(), codes)


INT_KERNELS = {"avx2": ("avx2", "AVX2"), "avx512_bf16": ("avx512_bf16", "AVX512-BF16")}
"""Each int4/int8 kernel -> (the ISA cap under which it is the one chosen, the instruction set a skip names)."""


@contextlib.contextmanager
def using_int_kernel(name: str) -> Iterator[None]:
    """Caps the ISA level so that kernel `name` serves, restores it after; skips, naming the ISA, where this host
    lacks it (the kernel must then be chosen: a fallback fails the assert)."""
    level, isa_name = INT_KERNELS[name]
    detected = native.module().detected_isa()
    if ISA_LEVELS.index(detected) < ISA_LEVELS.index(level):
        pytest.skip(isa_skip_reason(f"the {name} int4/int8 kernel", isa_name))
    previous = native.module().set_max_isa(level)
    try:
        assert cpu_int4.kernel_name() == name
        yield
    finally:
        native.module().set_max_isa(previous)


@pytest.mark.parametrize("kernel", list(INT_KERNELS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
@pytest.mark.parametrize("out,cols,gs", [(192, 576, 64), (70, 256, 128), (576, 1536, 64)])
def test_k64_kernel_matches_dequantized_reference(kernel, rows, out, cols, gs):
    """Every row-block shape of each kernel (R x M unrolls, a ragged tail of output rows) against
    the float32 product with the bf16-stored scales, and every row the same bits alone as in the batch."""
    with using_int_kernel(kernel):
        check_k64(rows, out, cols, gs)


def check_k64(rows: int, out: int, cols: int, gs: int) -> None:
    g = torch.Generator().manual_seed(rows)
    layer = _layer(out, cols, torch.bfloat16, bias=True)
    qw = quantize_groupwise(layer.weight.data.float(), 4, gs, False)
    install_quantized(layer, qw)
    assert layer.quant_method.layout == "k64"
    layer.quant_method.force_path = "kernel"
    x = torch.randn(rows, cols, generator=g).bfloat16()
    ref = x.float() @ layer.quant_method.dequantize(layer, torch.float32).t() + layer.bias.float()
    y = layer(x).float()
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-2
    for i in range(rows):
        assert torch.equal(layer(x[i : i + 1]).float(), y[i : i + 1])


CASES = [  # bits, out, in, group, sym, act_order
    (4, 192, 576, 64, True, False),  # k64 where the CPU has AVX2, else tinygemm
    (4, 70, 256, 128, False, True),  # k64 with N % 64 != 0 and act-order
    (4, 128, 256, 32, False, True),
    (3, 64, 128, 64, False, False),
    (4, 80, 128, 32, True, False),  # N % 64 != 0 -> plain nibble layout, dequant only
    (4, 64, 96, -1, False, False),  # per channel
    (8, 192, 576, -1, True, False),  # int8 kernel, symmetric
    (8, 192, 576, -1, False, False),  # int8 kernel + asymmetric correction
    (8, 64, 128, 32, False, False),  # grouped int8 -> dequant
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
    assert layer.quant_method.layout == ("k64" if cpu_int4.available() else "tinygemm")
    assert layer.qweight.numel() == 192 * 576 // 2  # 4 bits per weight
    assert layer.quant_method.path(1, torch.randn(1, 576, dtype=torch.bfloat16)) == "kernel"


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_plan_is_a_rule_of_rows_not_a_timing(bits):
    """The path depends on the row count, dtype and plan alone: the same call gives the same path (and
    bits) however loaded the machine is, and a plan with other limits moves the boundary exactly."""
    x = lambda m, dtype=torch.bfloat16: torch.zeros(m, 576, dtype=dtype)
    layer = _layer(192, 576, torch.bfloat16)
    plan = KernelPlan(int4_k64_max_rows=3, int4_tinygemm_max_rows=3, int8_max_rows=3)
    install_quantized(
        layer, quantize_groupwise(layer.weight.data.float(), bits, 64 if bits == 4 else -1, True), plan=plan
    )
    method = layer.quant_method
    path = (
        (lambda m, dtype=torch.bfloat16: method.path(m, x(m, dtype)))
        if bits == 4
        else (lambda m, dtype=torch.bfloat16: method.path(layer, x(m, dtype)))
    )
    assert [path(m) for m in (1, 2, 3, 4, 64)] == ["kernel"] * 3 + ["dequant"] * 2
    assert path(1, torch.float32) == "dequant"  # float32 activations always dequantize
    default = _layer(192, 576, torch.bfloat16)
    install_quantized(default, quantize_groupwise(default.weight.data.float(), bits, 64 if bits == 4 else -1, True))
    limit = DEFAULT_PLAN.int8_max_rows if bits == 8 else DEFAULT_PLAN.int4_k64_max_rows
    y1 = default(torch.ones(limit, 576, dtype=torch.bfloat16))
    y2 = default(torch.ones(limit, 576, dtype=torch.bfloat16))
    assert torch.equal(y1, y2)


def test_kernel_plan_rejects_negative_limits():
    with pytest.raises(ValueError, match="int8_max_rows"):
        KernelPlan(int8_max_rows=-1)


def test_forced_layout_that_cannot_serve_is_refused():
    layer = _layer(80, 128, torch.bfloat16)  # N % 64 != 0: no tinygemm
    with pytest.raises(ValueError, match="tinygemm"):
        install_quantized(layer, quantize_groupwise(layer.weight.data.float(), 4, 32, True), int4_layout="tinygemm")


@pytest.mark.parametrize("kernel", list(INT_KERNELS))
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_int8_gemv_matches_dequantized_reference(kernel, rows, sym):
    with using_int_kernel(kernel):
        check_int8(rows, sym)


def check_int8(rows: int, sym: bool) -> None:
    layer = _layer(200, 576, torch.bfloat16, bias=False)
    qw = quantize_groupwise(layer.weight.data.float(), 8, -1, sym)
    install_quantized(layer, qw)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    y = cpu_int4.int8_linear(x, layer.qweight, layer.scales, layer.offsets)
    assert y is not None and y.shape == (rows, 200)
    ref = x.float() @ layer.quant_method.dequantize(layer, torch.float32).t()
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    assert cpu_int4.int8_linear(torch.randn(9, 576).bfloat16(), layer.qweight, layer.scales, layer.offsets) is None
