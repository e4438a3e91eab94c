"""On the real default model: GPTQ's output error per linear on held-out activations is below RTN's."""

from __future__ import annotations

import pytest
import torch

from tokenmill.quant.calibration import (
    calibration_windows,
    capture_inputs,
    decoder_layers,
    default_data_dir,
    embed,
    linears_in_call_order,
    read_jsonl_texts,
    run_layer,
)
from tokenmill.quant.gptq import HessianAccumulator, gptq_quantize_weight
from tokenmill.quant.rtn import rtn_quantize_weight

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real():
    from tokenmill.models.loader import load_model

    data = default_data_dir() / "c4_en_train_00000_first1000.jsonl"
    if not data.is_file():
        pytest.fail(f"{data} not found: the shared data folder must sit next to the repository")
    loaded = load_model("smollm2-135m", dtype=torch.float32, gguf_dequantize=True)  # quantizers read dense weights
    ids = calibration_windows(
        read_jsonl_texts(data),
        lambda s: loaded.tokenizer.encode(s, add_special_tokens=False),
        num_windows=28,
        seqlen=512,
        seed=0,
    )
    # NOTE: down_proj has 1536 inputs; with only ~2k calibration tokens GPTQ overfits its Hessian and
    # loses to RTN on held-out data (measured: 0.042 vs 0.026 at 3 bits); from ~8k tokens on it wins.
    return loaded, ids[:24], ids[24:]  # calibration (12k tokens) / held out (2k tokens)


@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_beats_rtn_per_layer_on_held_out(real, bits):
    loaded, calib, held = real
    model = loaded.model
    layer = decoder_layers(model)[1]
    h_cal = run_layer(decoder_layers(model)[0], embed(model, calib))
    h_out = run_layer(decoder_layers(model)[0], embed(model, held))
    for name, lin in linears_in_call_order(layer, model.config.hidden_size):
        acc = HessianAccumulator(lin.in_features)
        capture_inputs(layer, lin, h_cal, acc.add_batch)
        xs: list[torch.Tensor] = []
        capture_inputs(layer, lin, h_out, xs.append)
        x = torch.cat(xs).reshape(-1, lin.in_features)
        w = lin.weight.data
        ref = x @ w.t()
        err = {}
        for method in ("rtn", "gptq"):
            if method == "rtn":
                qw = rtn_quantize_weight(w, bits, 64, sym=False)
            else:
                qw = gptq_quantize_weight(w, acc.H, bits, 64, sym=False).weight
            err[method] = float((x @ qw.dequantize().t() - ref).pow(2).sum() / ref.pow(2).sum())
        assert err["gptq"] < err["rtn"], (name, bits, err)
