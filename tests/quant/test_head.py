"""The quantized LM head / tied embedding (quant/head.py) and row dequantization."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.linear import Linear
from tokenmill.models.loader import load_model
from tokenmill.quant.head import QuantizedEmbedding, quantize_table, resolve_bits
from tokenmill.quant.kernels import dequantize_rows, install_quantized
from tokenmill.quant.pipeline import QuantConfig, quantize_model
from tokenmill.quant.rtn import rtn_quantize_weight
from tokenmill.quant.save import save_quantized

from .conftest import calib_ids, make_tiny_model


@pytest.mark.parametrize(
    "bits,group,sym,n", [(4, 64, False, 128), (4, 32, True, 96), (8, -1, True, 128), (8, 32, False, 128)]
)
def test_dequantize_rows_matches_reference(bits, group, sym, n):
    """int4 tinygemm layout (n % 64 == 0), int4 plain layout (n = 96), int8 per channel and grouped."""
    w = torch.randn(n, 128, generator=torch.Generator().manual_seed(bits + n))
    qw = rtn_quantize_weight(w, bits, group, sym)
    layer = Linear(128, n)
    install_quantized(layer, qw, torch.float32)
    rows = torch.tensor([0, 5, n - 1, 63, 64, 31, 32, 5])
    got = dequantize_rows(layer, rows, torch.float32)
    torch.testing.assert_close(got, qw.dequantize()[rows], atol=1e-6, rtol=1e-6)


def test_quantized_embedding_lookup_and_head():
    table = torch.randn(256, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    emb = QuantizedEmbedding(table, 8, torch.bfloat16)
    ref = quantize_table(table, 8).dequantize()
    ids = torch.tensor([[3, 255, 0], [7, 7, 128]])
    out = emb(ids)
    assert out.shape == (2, 3, 128) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref[ids], atol=2e-3, rtol=2e-2)  # scales held in bf16
    h = torch.randn(4, 128).to(torch.bfloat16)
    logits = emb.as_lm_head(h).float()
    torch.testing.assert_close(logits, h.float() @ ref.t(), atol=0.05, rtol=0.02)


def test_resolve_bits():
    assert resolve_bits("auto", None) is None
    assert resolve_bits("auto", 4) == 8 and resolve_bits("auto", 8) == 8
    assert resolve_bits("int4", None) == 4 and resolve_bits("none", 4) is None
    with pytest.raises(ValueError, match="quantize_lm_head"):
        resolve_bits("fp8", 4)


def test_loaded_checkpoint_gets_int8_head_in_bf16_only(tmp_path):
    model = make_tiny_model()
    qcfg = QuantConfig(method="rtn", bits=4, group_size=32)
    report = quantize_model(model, qcfg, None, progress=False)
    out = save_quantized(model, model.config, None, report.weights, qcfg.resolved_format, tmp_path / "q", qcfg.sym)
    plain = load_model(str(out), dtype=torch.bfloat16, load_tokenizer=False, quantize_lm_head="none").model
    auto = load_model(str(out), dtype=torch.bfloat16, load_tokenizer=False, quantize_lm_head="auto").model
    fp32 = load_model(str(out), dtype=torch.float32, load_tokenizer=False, quantize_lm_head="auto").model
    assert isinstance(auto.model.embed_tokens, QuantizedEmbedding)
    assert auto.model.embed_tokens.head.quant_bits == 8
    assert isinstance(fp32.model.embed_tokens, torch.nn.Embedding)
    assert isinstance(plain.model.embed_tokens, torch.nn.Embedding)
    ids = calib_ids(1, 16, seed=3)[0]
    with torch.no_grad():
        a = plain.compute_logits(plain(ids, torch.arange(16)))
        b = auto.compute_logits(auto(ids, torch.arange(16)))
    # int8 per-row table: logits move by a small fraction of their spread, the argmax mostly holds
    assert (a - b).abs().max() < 0.05 * a.std() * 10
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8
