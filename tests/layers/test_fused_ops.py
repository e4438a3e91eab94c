"""Fused CPU kernels against their PyTorch references (layers/fused_ops.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers import fused_ops
from tokenmill.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("each_isa")  # the generic C++ paths too

DTYPES = [torch.float32, torch.bfloat16]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to one rounding step of dtype (a float32 sum taken in another order may round
    the other way)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_add(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    r = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.rand(576, generator=g).to(dtype) + 0.5
    x0, r0 = x.clone(), r.clone()
    close(fused_ops.rms_norm(x, w, 1e-5), fused_ops.rms_norm_ref(x, w, 1e-5), dtype)
    out, s = fused_ops.add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_s = fused_ops.add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(s, ref_s)  # one rounded add: bit-exact
    close(out, ref_out, dtype)
    assert torch.equal(x, x0) and torch.equal(r, r0)  # inputs untouched
    if dtype == torch.bfloat16:  # mostly bit-exact; differences are single roundings
        assert (out != ref_out).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_leading_dims_and_fallback(dtype):
    x = torch.randn(2, 5, 64).to(dtype)
    w = torch.rand(64).to(dtype)
    close(fused_ops.rms_norm(x, w, 1e-6), fused_ops.rms_norm_ref(x, w, 1e-6), dtype)
    xt = torch.randn(64, 6).to(dtype).t()  # not contiguous -> reference path, same values
    assert torch.equal(fused_ops.rms_norm(xt, w, 1e-6), fused_ops.rms_norm_ref(xt, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_silu_and_mul(dtype, rows):
    x = (torch.randn(rows, 2 * 1536) * 4).to(dtype)
    close(fused_ops.silu_and_mul(x), fused_ops.silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_gelu_tanh_and_mul(dtype, rows):
    """GeGLU (Gemma) against F.gelu(approximate="tanh") * up, rounding where it does (the gelu, then the
    product). In float32 the oracle is that reference taken in float64: the float32 one computes 1 + tanh(z),
    which cancels for gates below about -4 (2e-6 off, seen), where the kernel's sigmoid form does not."""
    x = (torch.randn(rows, 2 * 1544) * 4).to(dtype)  # 1544: a tail after the 16- and 8-lane parts
    x[0, :8] = torch.tensor([-30.0, -9.0, -5.0, -0.0, 1e-7, 5.0, 9.0, 30.0])  # saturated and tiny gates
    ref = fused_ops.gelu_tanh_and_mul_ref(x.double() if dtype == torch.float32 else x).to(dtype)
    close(fused_ops.gelu_tanh_and_mul(x), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_unit_offset(dtype, rows):
    """Gemma's norm, x / rms * (1 + w) in float32 with one rounding, against its reference (layers/norm.py's
    formula); H = 640 plus a 584 run for the scalar tail."""
    g = torch.Generator().manual_seed(rows)
    for h in (640, 584):
        x = (torch.randn(rows, h, generator=g) * 3).to(dtype)
        w = (torch.rand(h, generator=g) - 0.5).to(dtype)
        close(fused_ops.rms_norm_unit_offset(x, w, 1e-6), fused_ops.rms_norm_unit_offset_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("head_dim", [24, 64, 256])
def test_head_rms_norm_inplace(dtype, unit_offset, head_dim):
    """QK-norm in place on packed q | k | v rows: the q heads, then the k heads through a strided view, each head
    as its reference norm would norm it; v and the other heads untouched."""
    hq, hkv, n = 4, 2, 9
    g = torch.Generator().manual_seed(head_dim)
    qkv = (torch.randn(n, (hq + 2 * hkv) * head_dim, generator=g) * 3).to(dtype)
    wq = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    wk = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    ref_norm = fused_ops.rms_norm_unit_offset_ref if unit_offset else fused_ops.rms_norm_ref
    q_size, kv_size = hq * head_dim, hkv * head_dim
    q_ref = ref_norm(qkv[:, :q_size].reshape(n, hq, head_dim), wq, 1e-6)
    k_ref = ref_norm(qkv[:, q_size : q_size + kv_size].reshape(n, hkv, head_dim), wk, 1e-6)
    got = qkv.clone()
    assert fused_ops.head_rms_norm_inplace(got, hq, head_dim, wq, 1e-6, unit_offset)
    assert fused_ops.head_rms_norm_inplace(got[:, q_size:], hkv, head_dim, wk, 1e-6, unit_offset)
    close(got[:, :q_size].reshape(n, hq, head_dim), q_ref, dtype)
    close(got[:, q_size : q_size + kv_size].reshape(n, hkv, head_dim), k_ref, dtype)
    assert torch.equal(got[:, q_size + kv_size :], qkv[:, q_size + kv_size :])
    # a head normed on its own (a contiguous [1, head_dim] row) gives the same bits as inside the packed row
    one = qkv[3:4, q_size + head_dim : q_size + 2 * head_dim].clone()
    assert fused_ops.head_rms_norm_inplace(one, 1, head_dim, wk, 1e-6, unit_offset)
    assert torch.equal(one[0], got[3, q_size + head_dim : q_size + 2 * head_dim])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_packed_matches_reference(dtype, scaling):
    hq, hkv, d, n = 9, 3, 64, 11
    rot = RotaryEmbedding(d, 4096, 10000.0, scaling)
    positions = torch.tensor([0, 1, 2, 5, 100, 4095, 7, 7, 3000, 64, 65])
    qkv = torch.randn(n, (hq + 2 * hkv) * d).to(dtype)
    q_size, kv_size = hq * d, hkv * d
    q_ref, k_ref = rot(
        positions, qkv[:, :q_size].reshape(n, hq, d), qkv[:, q_size : q_size + kv_size].reshape(n, hkv, d)
    )
    v_ref = qkv[:, q_size + kv_size :].reshape(n, hkv, d).clone()
    q, k, v = rot.rotate_packed(positions, qkv.clone(), hq, hkv)
    close(q, q_ref, dtype)
    close(k, k_ref, dtype)
    assert torch.equal(v, v_ref)
    # batched dense layout [B, T, ...] goes through the same kernel
    q2, _, _ = rot.rotate_packed(positions.reshape(1, n), qkv.clone().reshape(1, n, -1), hq, hkv)
    assert torch.equal(q2[0], q)


def test_unsupported_dtype_falls_back():
    x = torch.randn(3, 16, dtype=torch.float64)
    assert torch.equal(fused_ops.silu_and_mul(x), fused_ops.silu_and_mul_ref(x))
    w = torch.ones(16, dtype=torch.float64)
    assert torch.equal(fused_ops.rms_norm(x, w, 1e-6), fused_ops.rms_norm_ref(x, w, 1e-6))
    assert not fused_ops.rope_inplace(
        torch.randn(2, 8, dtype=torch.float64), 1, 8, torch.zeros(4, 8), torch.zeros(2, dtype=torch.long)
    )
    assert torch.equal(fused_ops.gelu_tanh_and_mul(x), fused_ops.gelu_tanh_and_mul_ref(x))
    assert torch.equal(fused_ops.rms_norm_unit_offset(x, w, 1e-6), fused_ops.rms_norm_unit_offset_ref(x, w, 1e-6))
    assert not fused_ops.head_rms_norm_inplace(x.clone(), 2, 8, w[:8], 1e-6, False)


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("bias", [False, True])
def test_vnni_linear_matches_float32_reference(rows, bias, monkeypatch, each_isa):
    """Every row count 1..8 (the 7-8 row path runs two passes over each weight chunk), with and without
    bias, on a matrix large enough to be split across threads: one bf16 rounding of the exact sum."""
    torch.manual_seed(rows)
    n, k = 320, 576
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, k).to(torch.bfloat16)
    vnni = fused_ops.pack_vnni(w)
    if each_isa not in ("avx512_bf16", "amx"):  # the kernels need AVX512-BF16: no packed copy, no half-path
        assert vnni is None
        return
    assert vnni.shape == (n // 64, k // 2, 64, 2)
    assert torch.equal(vnni[1, 3, 5], w[64 + 5, 6:8])  # chunk 1, k-pair 3, output 5 of the chunk
    y = x.new_empty(rows, n)
    assert torch.ops.tokenmill.linear_bf16_vnni(y, x, vnni, b)
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert y is not None and y.dtype == torch.bfloat16 and y.shape == (rows, n)
    # float32 accumulation then one rounding to bf16: within one bf16 ulp (2^-8 relative) plus float32 noise
    assert torch.all((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-3)


def test_vnni_pack_declines_shapes_it_cannot_serve():
    assert fused_ops.pack_vnni(torch.zeros(96, 64, dtype=torch.bfloat16)) is None  # N % 64
    assert fused_ops.pack_vnni(torch.zeros(64, 63, dtype=torch.bfloat16)) is None  # K odd
    assert fused_ops.pack_vnni(torch.zeros(64, 64, dtype=torch.float32)) is None  # not bf16


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 9, 64])
def test_dense_linear_without_vnni_is_f_linear_or_the_gemv(bias, rows, each_isa):
    """The dense rule without a VNNI copy: oneDNN's prepacked weight gives F.linear's bits exactly (above
    the GEMV's rows), and so does at::linear at the generic level; the GEMV's few rows, and the AVX2 kernel's
    rows at any count, are one rounding of the float32 sum."""
    torch.manual_seed(rows)
    w = torch.randn(160, 96).to(torch.bfloat16)
    b = torch.randn(160).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 96).to(torch.bfloat16)
    packed = fused_ops.pack_onednn(w)
    y = fused_ops.dense_linear(x, w, None, packed, b)
    ref = F.linear(x, w, b)
    small = rows <= 8 and rows * 160 <= 5000
    if packed is not None and not small or each_isa == "generic":
        assert torch.equal(y, ref)
    else:
        exact = x.double() @ w.double().t() + (b.double() if bias else 0)
        assert torch.all((y.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3)


def test_dense_linear_float32_one_row_is_the_gemv_else_f_linear():
    torch.manual_seed(0)
    w, x = torch.randn(128, 64), torch.randn(5, 64)
    assert torch.equal(fused_ops.dense_linear(x, w, None, None, None), F.linear(x, w))
    torch.testing.assert_close(
        fused_ops.dense_linear(x[:1], w, None, None, None), F.linear(x[:1], w), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_glue_gives_the_scalar_bits(dtype, each_isa):
    """RMSNorm (plain and unit-offset, whole rows and per head), the residual add and RoPE run 16 lanes at a time
    on AVX-512 and element by element below it (csrc/fused_ops.cpp): the same float32 products and roundings, so
    the same bits at every level. H = 584 leaves a scalar tail after the vector part; head_dim 48 gives each RoPE
    half a tail too."""
    from tokenmill import native

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(13, 584, generator=g) * 3).to(dtype)
    r = torch.randn(13, 584, generator=g).to(dtype)
    w = (torch.rand(584, generator=g) + 0.5).to(dtype)
    cos_sin = torch.randn(64, 48, generator=g)
    pos = torch.randint(0, 64, (13,), generator=g)
    qk = torch.randn(13, 5 * 48, generator=g).to(dtype)

    def run():
        out, s = fused_ops.add_rms_norm(x, r, w, 1e-5)
        rot = qk.clone()
        assert fused_ops.rope_inplace(rot, 5, 48, cos_sin, pos)
        heads, heads1p = qk.clone(), qk.clone()  # QK-norm: a 48-wide head leaves a tail after 32
        assert fused_ops.head_rms_norm_inplace(heads, 5, 48, w[:48], 1e-5, False)
        assert fused_ops.head_rms_norm_inplace(heads1p, 5, 48, w[:48], 1e-5, True)
        unit = fused_ops.rms_norm_unit_offset(x, w, 1e-5)
        return fused_ops.rms_norm(x, w, 1e-5), out, s, rot, heads, heads1p, unit

    level = each_isa
    got = run()
    previous = native.module().set_max_isa("generic")
    try:
        scalar = run()
    finally:
        native.module().set_max_isa(previous)
    assert native.isa() == level
    for a, b in zip(got, scalar):
        assert torch.equal(a, b)
