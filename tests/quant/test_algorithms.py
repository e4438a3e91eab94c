"""RTN / GPTQ / AWQ as pure functions, plus the perplexity protocol."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.eval.perplexity import evaluate_perplexity, make_windows
from tokenmill.quant.awq import apply_clip, awq_quantize_block, awq_search_clip, fold_scales
from tokenmill.quant.gptq import HessianAccumulator, gptq_quantize_weight
from tokenmill.quant.rtn import rtn_quantize_weight

from .conftest import calib_ids, make_tiny_model


def _xw(seed=0, out=48, cols=128, n=512):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(cols, generator=g))  # channels of very different magnitude
    mix = torch.randn(32, cols, generator=g)  # correlated channels, like real activations
    x = (torch.randn(n, 32, generator=g) @ mix + 0.3 * torch.randn(n, cols, generator=g)) * scale
    w = torch.randn(out, cols, generator=g) * 0.1
    return x, w


def test_rtn_grid_and_error_bound():
    _, w = _xw()
    for sym in (True, False):
        qw = rtn_quantize_weight(w, 4, 32, sym)
        assert qw.codes.max() <= 15 and qw.scales.shape == (48, 4)
        err = (qw.dequantize() - w).abs()
        s = qw.scales.float()[:, qw.g_idx.long()]
        assert (err <= s * (0.5 + 1e-3) + (1.0 if sym else 0) * s).all()  # sym clips the top value by one step


def test_gptq_with_identity_hessian_is_rtn():
    _, w = _xw()
    H = torch.eye(w.shape[1]) * 3.0
    g = gptq_quantize_weight(w, H, 4, 32, sym=False).weight
    r = rtn_quantize_weight(w, 4, 32, sym=False)
    assert torch.equal(g.codes, r.codes) and torch.equal(g.scales, r.scales) and torch.equal(g.zeros, r.zeros)


def test_hessian_accumulator_is_2xtx_over_n():
    x, _ = _xw()
    acc = HessianAccumulator(x.shape[1])
    for part in x.split(100):
        acc.add_batch(part)
    torch.testing.assert_close(acc.H, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("act_order,static", [(False, False), (True, False), (True, True)])
def test_gptq_beats_rtn_on_output_error(act_order, static):
    x, w = _xw()
    acc = HessianAccumulator(x.shape[1])
    acc.add_batch(x)
    res = gptq_quantize_weight(w, acc.H, 3, 32, sym=False, act_order=act_order, static_groups=static, block_size=32)
    qw = res.weight
    if static or not act_order:
        assert qw.has_trivial_g_idx
    else:
        assert not qw.has_trivial_g_idx
        assert torch.equal(torch.bincount(qw.g_idx.long()), torch.full((4,), 32))
    rtn = rtn_quantize_weight(w, 3, 32, sym=False)
    err = lambda q: float((x @ (q.dequantize() - w).t()).pow(2).mean())  # noqa: E731
    assert err(qw) < 0.7 * err(rtn)
    assert res.loss > 0


def test_awq_fold_scales_preserves_function_and_clip_shapes():
    model = make_tiny_model()
    layer = model.model.layers[0]
    h = model.model.embed_tokens(calib_ids(2, 16))
    pos = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        before = layer(pos, h)
        s = torch.rand(128) + 0.5
        fold_scales(layer.input_layernorm, [layer.self_attn.qkv_proj], s)
        s2 = torch.rand(256) + 0.5
        fold_scales((layer.mlp.gate_up_proj, layer.mlp.gate_up_proj.shard_rows(1)), [layer.mlp.down_proj], s2)
        after = layer(pos, h)
    torch.testing.assert_close(before, after, rtol=1e-4, atol=1e-5)
    w = layer.mlp.down_proj.weight.data
    m = awq_search_clip(w, torch.randn(64, 256), 4, 32, n_grid=20)
    assert m.shape == (128, 8)
    orig = w.abs().reshape(128, 8, 32).amax(-1)
    assert (m <= orig + 1e-6).all() and (m >= 0.5 * orig - 1e-6).all()
    assert apply_clip(w, m).abs().reshape(128, 8, 32).amax(-1).le(m + 1e-6).all()


def test_awq_block_beats_rtn_block():
    ids = calib_ids(8, 32)
    ref = make_tiny_model()
    h = ref.model.embed_tokens(ids)
    pos = torch.arange(32).expand(8, 32)
    with torch.no_grad():
        target = ref.model.layers[0](pos, h)
        awq_model = make_tiny_model()
        awq_quantize_block(awq_model.model.layers[0], h, 3, 32, n_grid=10)
        out_awq = awq_model.model.layers[0](pos, h)
        rtn_model = make_tiny_model()
        for lin in (
            rtn_model.model.layers[0].self_attn.qkv_proj,
            rtn_model.model.layers[0].self_attn.o_proj,
            rtn_model.model.layers[0].mlp.gate_up_proj,
            rtn_model.model.layers[0].mlp.down_proj,
        ):
            lin.weight.data = rtn_quantize_weight(lin.weight.data, 3, 32, sym=False).dequantize()
        out_rtn = rtn_model.model.layers[0](pos, h)
    assert (out_awq - target).pow(2).mean() < (out_rtn - target).pow(2).mean()


def test_perplexity_protocol_windows_and_value():
    ids = torch.arange(10)
    assert make_windows(ids, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # tail [8, 9] dropped
    with pytest.raises(ValueError):
        make_windows(ids, 11)
    model = make_tiny_model()
    text = calib_ids(1, 100).flatten()
    res = evaluate_perplexity(model, text, seqlen=32, progress=False)
    assert res.num_windows == 3 and res.total_windows == 3
    # oracle: mean NLL over the 3 windows' 31 predicted tokens each, from batched logits
    with torch.no_grad():
        w = make_windows(text, 32)
        logits = model.compute_logits(model(w, torch.arange(32).expand(3, 32)))
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), w[:, 1:].reshape(-1))
    assert math.isclose(res.perplexity, math.exp(float(nll)), rel_tol=1e-4)
