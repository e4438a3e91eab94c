"""Fused CPU kernels against their PyTorch references (layers/fused_ops.py)."""
from __future__ import annotations

import pytest
import torch

from tokenmill.layers import fused_ops
from tokenmill.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not fused_ops.is_available(), reason="C++ kernels could not be built here")

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
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_packed_matches_reference(dtype, scaling):
    hq, hkv, d, n = 9, 3, 64, 11
    rot = RotaryEmbedding(d, 4096, 10000.0, scaling)
    positions = torch.tensor([0, 1, 2, 5, 100, 4095, 7, 7, 3000, 64, 65])
    qkv = torch.randn(n, (hq + 2 * hkv) * d).to(dtype)
    q_size, kv_size = hq * d, hkv * d
    q_ref, k_ref = rot(positions, qkv[:, :q_size].reshape(n, hq, d), qkv[:, q_size:q_size + kv_size].reshape(n, hkv, d))
    v_ref = qkv[:, q_size + kv_size:].reshape(n, hkv, d).clone()
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
    assert not fused_ops.rope_inplace(torch.randn(2, 8, dtype=torch.float64), 1, 8, torch.zeros(4, 8),
                                      torch.zeros(2, dtype=torch.long))
