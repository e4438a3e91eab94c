"""A tiny model quantized and saved in each format loads back with identical logits."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill.models.loader import ModelLoadError, load_model
from tokenmill.quant.pipeline import QuantConfig, quantize_model
from tokenmill.quant.save import save_quantized

from .conftest import calib_ids, make_tiny_model

CONFIGS = [
    QuantConfig(method="gptq", bits=4, group_size=32, sym=True),
    QuantConfig(method="gptq", bits=4, group_size=32, sym=False, desc_act=True),
    QuantConfig(method="gptq", bits=3, group_size=64, sym=False, desc_act=True, static_groups=True),
    QuantConfig(method="rtn", bits=8, group_size=-1, sym=True),
    QuantConfig(method="awq", bits=4, group_size=32, awq_n_grid=4),
    QuantConfig(method="awq", bits=3, group_size=32, awq_n_grid=4),  # -> GPTQ format
]


def _logits(model, ids):
    with torch.no_grad():
        pos = torch.arange(ids.shape[-1]).expand(ids.shape)
        return model.compute_logits(model(ids, pos))


@pytest.mark.parametrize(
    "qcfg",
    CONFIGS,
    ids=lambda c: f"{c.method}-w{c.bits}-g{c.group_size}-{c.resolved_format}{'-act' if c.desc_act else ''}",
)
def test_quantized_tiny_model_round_trip(tmp_path, qcfg):
    model = make_tiny_model(attention_bias=qcfg.method == "rtn")
    report = quantize_model(model, qcfg, calib_ids(4, 32), progress=False)
    out = save_quantized(
        model,
        model.config,
        None,
        report.weights,
        qcfg.resolved_format,
        tmp_path / "q",
        qcfg.sym,
        qcfg.desc_act,
        qcfg.static_groups,
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == qcfg.resolved_format
    assert cfg["quantization_config"]["bits"] == qcfg.bits
    if qcfg.resolved_format == "gptq":
        assert json.loads((out / "quantize_config.json").read_text())["desc_act"] == qcfg.desc_act
    loaded = load_model(str(out), load_tokenizer=False)
    names = dict(loaded.model.named_modules())
    assert names["model.layers.0.self_attn.qkv_proj"].weight is None
    ids = calib_ids(2, 16, seed=9)
    assert torch.equal(_logits(model, ids), _logits(loaded.model, ids))


def test_truncated_quantized_checkpoint_is_clear_error(tmp_path):
    model = make_tiny_model()
    qcfg = QuantConfig(method="rtn", bits=4, group_size=32)
    rep = quantize_model(model, qcfg, progress=False)
    out = save_quantized(model, model.config, None, rep.weights, "gptq", tmp_path / "q", False)
    from safetensors.torch import load_file, save_file

    t = load_file(str(out / "model.safetensors"))
    del t["model.layers.1.mlp.up_proj.qzeros"]
    save_file(t, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="up_proj lacks"):
        load_model(str(out), load_tokenizer=False)


def test_autogptq_zero_biases_load_and_nonzero_biases_are_refused(tmp_path):
    """AutoGPTQ writes an all-zero `bias` next to every quantized layer, also for models without
    biases: those load (and change nothing); a real bias on a bias-free architecture is an error."""
    model = make_tiny_model()
    qcfg = QuantConfig(method="rtn", bits=4, group_size=32)
    rep = quantize_model(model, qcfg, progress=False)
    out = save_quantized(model, model.config, None, rep.weights, "gptq", tmp_path / "q", False)
    from safetensors.torch import load_file, save_file

    t = load_file(str(out / "model.safetensors"))
    plain = load_model(str(out), load_tokenizer=False).model
    for name in [n for n in t if n.endswith(".qweight")]:
        prefix = name.removesuffix(".qweight")
        t[f"{prefix}.bias"] = torch.zeros(t[f"{prefix}.scales"].shape[1], dtype=torch.float16)
    save_file(t, str(out / "model.safetensors"))
    with_zero = load_model(str(out), load_tokenizer=False).model
    ids = calib_ids(2, 16, seed=4)
    assert torch.equal(_logits(plain, ids), _logits(with_zero, ids))
    t["model.layers.0.self_attn.k_proj.bias"][0] = 0.5
    save_file(t, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="bias for a layer built without one"):
        load_model(str(out), load_tokenizer=False)
