"""The LM head / tied embedding quantized with GPTQ by `tokenmill quantize --lm-head`, saved in the
GPTQ layout (lm_head.qweight ... with "lm_head": true) and loaded back as the model's head."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import isa_skip_reason
from tokenmill.models.loader import ModelLoadError, load_model
from tokenmill.quant import kernels
from tokenmill.quant.gptq import gptq_quantize_weight
from tokenmill.quant.head import QuantizedEmbedding
from tokenmill.quant.kernels import dequantize_rows
from tokenmill.quant.pipeline import (
    QuantConfig,
    final_hidden_hessian,
    gptq_quantize_layers,
    head_weight,
    quantize_model,
)
from tokenmill.quant.rtn import rtn_quantize_weight
from tokenmill.quant.save import save_quantized

from .conftest import calib_ids, make_tiny_model


def _logits(model, ids):
    with torch.no_grad():
        pos = torch.arange(ids.shape[-1]).expand(ids.shape)
        return model.compute_logits(model(ids, pos))


def _quantize_and_save(tmp_path, qcfg, tied=True, n_calib=8, layers=2):
    model = make_tiny_model(tie_word_embeddings=tied, num_hidden_layers=layers)
    table = model.model.embed_tokens.weight.data.clone()
    report = quantize_model(model, qcfg, calib_ids(n_calib, 64), progress=False)
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
    return model, report, out, table


def test_gptq_head_error_on_held_out_hidden_states_is_below_rtn():
    """H from the final hidden states of the quantized model on calibration windows; the error is
    measured on the final hidden states of other windows: ‖X(W − Q)ᵀ‖² / ‖XWᵀ‖²."""
    model = make_tiny_model()
    quantize_model(model, QuantConfig(method="rtn", bits=4, group_size=64), progress=False)
    H = final_hidden_hessian(model, calib_ids(16, 64, seed=1)).H
    W = head_weight(model).float()
    gptq = gptq_quantize_weight(W, H, 4, 64, sym=False, min_zero=1).weight.dequantize()
    rtn = rtn_quantize_weight(W, 4, 64, sym=False, min_zero=1).dequantize()
    held_out = calib_ids(8, 64, seed=77)
    with torch.no_grad():
        X = model.model(held_out, torch.arange(64).expand(held_out.shape)).reshape(-1, W.shape[1])
    ref = (X @ W.t()).pow(2).sum()
    err_gptq = float((X @ (W - gptq).t()).pow(2).sum() / ref)
    err_rtn = float((X @ (W - rtn).t()).pow(2).sum() / ref)
    assert err_gptq < 0.9 * err_rtn, (err_gptq, err_rtn)


def test_gptq_reuses_its_last_block_outputs_for_the_head_hessian():
    """For --method gptq the head's H comes from the hidden states sequential GPTQ already computed;
    they are the final hidden states a forward pass of the quantized model gives."""
    model = make_tiny_model(num_hidden_layers=1)
    ids = calib_ids(4, 32)
    final = []
    gptq_quantize_layers(
        model, QuantConfig(method="gptq", bits=4, group_size=64), ids, progress=False, final_hidden=final
    )
    reused = final_hidden_hessian(model, ids, last_block_out=final[0]).H
    forward = final_hidden_hessian(model, ids).H
    torch.testing.assert_close(reused, forward, rtol=1e-4, atol=1e-5 * float(forward.diag().mean()))


@pytest.mark.parametrize(
    "qcfg,tied,layout",
    [
        (QuantConfig(method="gptq", bits=4, group_size=64, lm_head=True), True, "k64"),
        (QuantConfig(method="gptq", bits=4, group_size=32, desc_act=True, lm_head=True), True, "tinygemm"),
        (QuantConfig(method="gptq", bits=4, group_size=64, lm_head=True), False, "k64"),
        (QuantConfig(method="rtn", bits=4, group_size=64, lm_head=True), True, "k64"),
        (QuantConfig(method="awq", bits=4, group_size=64, awq_n_grid=4, format="gptq", lm_head=True), True, "k64"),
    ],
    ids=["gptq-g64-tied", "gptq-g32-act-tied", "gptq-g64-untied", "rtn-g64-tied", "awq-g64-gptqformat-tied"],
)
def test_quantized_head_round_trip(tmp_path, qcfg, tied, layout):
    if layout == "k64" and not kernels.cpu_int4.available():
        layout = "tinygemm"  # below AVX2 (or no C++ kernels): the k64 layout is not built
    model, report, out, table = _quantize_and_save(tmp_path, qcfg, tied, n_calib=4, layers=1)
    head_qw = report.weights["lm_head"]
    assert report.head_seconds > 0
    # the file: GPTQ tensors of the head, the fp16 embedding kept, tie_word_embeddings as it was
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["lm_head"] is True
    assert json.loads((out / "quantize_config.json").read_text())["lm_head"] is True
    assert cfg["tie_word_embeddings"] is tied
    t = load_file(str(out / "model.safetensors"))
    assert {"lm_head.qweight", "lm_head.qzeros", "lm_head.scales", "lm_head.g_idx"} <= set(t)
    assert "lm_head.weight" not in t
    assert t["model.embed_tokens.weight"].dtype == torch.float16
    assert torch.equal(t["model.embed_tokens.weight"], table.to(torch.float16))
    # the in-memory model already runs on the quantized head
    if tied:
        assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    else:
        assert model.lm_head.weight is None
    loaded = load_model(str(out), load_tokenizer=False).model
    ids = calib_ids(2, 16, seed=9)
    assert torch.equal(_logits(model, ids), _logits(loaded, ids))
    deq = head_qw.dequantize()
    if tied:
        emb = loaded.model.embed_tokens
        assert isinstance(emb, QuantizedEmbedding) and emb.head.quant_bits == 4
        assert emb.head.quant_method.layout == layout
        assert not any(p.numel() == deq.numel() for p in loaded.parameters())  # the fp16 table is gone
        torch.testing.assert_close(emb(ids), deq[ids], atol=1e-6, rtol=1e-6)
    else:
        assert loaded.lm_head.weight is None and loaded.lm_head.quant_bits == 4
        assert isinstance(loaded.model.embed_tokens, torch.nn.Embedding)


@pytest.mark.parametrize("layout", ["k64", "tinygemm", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookups_equal_dequantized_rows_in_each_int4_layout(monkeypatch, layout, dtype):
    """The same QuantizedEmbedding serves lookups (dequantize_rows) and logits in every int4 layout,
    act-order g_idx included."""
    vocab = 96 if layout == "plain" else 256  # plain: a vocabulary that is not a multiple of 64
    if layout == "k64" and not kernels.cpu_int4.available():
        pytest.skip(isa_skip_reason("the k64 int4 layout", "AVX2"))
    if layout != "k64":
        monkeypatch.setattr(kernels.cpu_int4, "available", lambda: False)
    gen = torch.Generator().manual_seed(3)
    W = torch.randn(vocab, 128, generator=gen) * 0.05
    X = torch.randn(512, 128, generator=gen) * torch.linspace(0.2, 3, 128)
    qw = gptq_quantize_weight(W, X.t() @ X / 512, 4, 64, sym=False, act_order=True, min_zero=1).weight
    assert not qw.has_trivial_g_idx
    emb = QuantizedEmbedding(qw, None, dtype)
    assert emb.head.quant_method.layout == layout
    deq = qw.dequantize()
    ids = torch.tensor([[0, 5, vocab - 1, 63], [64, 31, 32, 5]])
    got = emb(ids)
    assert got.dtype == dtype and got.shape == (2, 4, 128)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(got.float(), deq[ids], **tol)
    torch.testing.assert_close(dequantize_rows(emb.head, torch.arange(vocab), torch.float32), deq, **tol)
    h = torch.randn(3, 128, generator=gen)
    torch.testing.assert_close(
        emb.as_lm_head(h.to(dtype)).float(),
        h.to(dtype).float() @ deq.t(),
        atol=0.05 if dtype == torch.bfloat16 else 1e-4,
        rtol=0.02,
    )


def test_quantize_lm_head_choices_with_a_quantized_head(tmp_path):
    qcfg = QuantConfig(method="gptq", bits=4, group_size=64, lm_head=True)
    model, report, out, table = _quantize_and_save(tmp_path, qcfg, n_calib=4, layers=1)
    deq = report.weights["lm_head"].dequantize()
    every = torch.arange(deq.shape[0])

    def head_rows(m):
        return dequantize_rows(m.model.embed_tokens.head, every, torch.float32)

    # auto (also in bf16, where it would otherwise mean an int8 RTN head) and load_model's default
    # ("checkpoint") take the checkpoint's GPTQ head
    for choice, dtype in [("auto", torch.bfloat16), ("auto", torch.float32), ("checkpoint", torch.float32)]:
        m = load_model(str(out), dtype=dtype, load_tokenizer=False, quantize_lm_head=choice).model
        assert isinstance(m.model.embed_tokens, QuantizedEmbedding), choice
        assert m.model.embed_tokens.head.quant_bits == 4
        torch.testing.assert_close(head_rows(m), deq, atol=2e-3 if dtype == torch.bfloat16 else 1e-6, rtol=1e-2)
    # explicit choices keep their meaning: built from the fp16 table
    none = load_model(str(out), load_tokenizer=False, quantize_lm_head="none").model
    assert isinstance(none.model.embed_tokens, torch.nn.Embedding)
    assert torch.equal(none.model.embed_tokens.weight, table.to(torch.float16).float())
    int8 = load_model(str(out), dtype=torch.bfloat16, load_tokenizer=False, quantize_lm_head="int8").model
    assert int8.model.embed_tokens.head.quant_bits == 8
    int4 = load_model(str(out), load_tokenizer=False, quantize_lm_head="int4").model
    rtn = rtn_quantize_weight(table.to(torch.float16).float(), 4, 64, sym=False).dequantize()
    torch.testing.assert_close(head_rows(int4), rtn, atol=1e-6, rtol=1e-6)
    assert not torch.equal(head_rows(int4), deq)
    with pytest.raises(ValueError, match="quantize_lm_head"):
        load_model(str(out), load_tokenizer=False, quantize_lm_head="fp8")


def test_untied_quantized_head_refuses_an_rtn_choice(tmp_path):
    qcfg = QuantConfig(method="rtn", bits=4, group_size=64, lm_head=True)
    _, _, out, _ = _quantize_and_save(tmp_path, qcfg, tied=False)
    assert load_model(str(out), load_tokenizer=False, quantize_lm_head="auto").model.lm_head.quant_bits == 4
    with pytest.raises(ModelLoadError, match="lm_head is quantized .* no fp16 head"):
        load_model(str(out), load_tokenizer=False, quantize_lm_head="int8")


def test_corrupted_lm_head_is_a_clear_error_naming_the_file(tmp_path):
    qcfg = QuantConfig(method="rtn", bits=4, group_size=64, lm_head=True)
    _, _, out, _ = _quantize_and_save(tmp_path, qcfg)
    f = out / "model.safetensors"
    good = load_file(str(f))
    t = dict(good, **{"lm_head.qweight": good["lm_head.qweight"][:-1].clone()})
    save_file(t, str(f))
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: the LM head: qweight has shape \[15, 256\], "
        r"expected \[16, 256\]",
    ):
        load_model(str(out), load_tokenizer=False)
    t = dict(good, **{"lm_head.scales": good["lm_head.scales"][:, :-8].clone()})
    save_file(t, str(f))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: the LM head: scales has shape"):
        load_model(str(out), load_tokenizer=False)
    t = {k: v for k, v in good.items() if k != "lm_head.qzeros"}
    save_file(t, str(f))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: lm_head lacks \['qzeros'\]"):
        load_model(str(out), load_tokenizer=False)
    t = {k: v for k, v in good.items() if not k.startswith("lm_head.")}
    save_file(t, str(f))
    with pytest.raises(ModelLoadError, match="says lm_head is quantized, but the checkpoint has no lm_head.qweight"):
        load_model(str(out), load_tokenizer=False)


def test_awq_format_refuses_the_flag_and_default_is_off(tmp_path):
    with pytest.raises(ValueError, match="GPTQ layout only.*--format gptq"):
        QuantConfig(method="awq", bits=4, lm_head=True)
    assert QuantConfig(method="awq", bits=4, format="gptq", lm_head=True).resolved_format == "gptq"
    # off by default: the checkpoint is what it was (fp16 table, lm_head false, no lm_head tensors)
    model, report, out, _ = _quantize_and_save(tmp_path, QuantConfig(method="rtn", bits=4, group_size=64))
    assert "lm_head" not in report.weights and report.head_seconds == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["lm_head"] is False
    assert "lm_head" not in json.loads((out / "quantize_config.json").read_text())
    assert not any(k.startswith("lm_head") for k in load_file(str(out / "model.safetensors")))
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_serves_a_checkpoint_with_a_quantized_tied_head(tmp_path, gguf_tokenizer, dtype):
    """Tied tiny Llama (real vocabulary), RTN w4 g64 with --lm-head, through the engine (chunked
    prefill, batched decode; in bf16 the CPU decode loop): float32 decodes exactly what a greedy loop
    over the loaded model decodes; bfloat16 runs on the same quantized table."""
    from tokenmill.engine.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    model = make_tiny_model(vocab_size=gguf_tokenizer.vocab_size, hidden_size=64, head_dim=16, intermediate_size=128)
    qcfg = QuantConfig(method="rtn", bits=4, group_size=64, lm_head=True)
    report = quantize_model(model, qcfg, progress=False)
    out = save_quantized(model, model.config, gguf_tokenizer, report.weights, "gptq", tmp_path / "q", False)
    prompts = ["The quick brown fox jumps over", "Hello"]
    llm = LLM(model=str(out), dtype=dtype, max_model_len=128, num_gpu_blocks_override=64, max_num_batched_tokens=16)
    emb = llm.engine.model.model.embed_tokens
    assert isinstance(emb, QuantizedEmbedding) and emb.head.quant_bits == 4  # the checkpoint's, not int8 RTN
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    if dtype == "float32":
        ref = load_model(str(out), dtype=torch.float32)
        assert isinstance(ref.model.model.embed_tokens, QuantizedEmbedding)
        for p, o in zip(prompts, outs):
            ids = ref.tokenizer.encode(p)
            seq = list(ids)
            with torch.no_grad():
                for _ in range(6):
                    logits = ref.model.compute_logits(ref.model(torch.tensor(seq), torch.arange(len(seq)))[-1:])
                    seq.append(int(logits.argmax(-1)))
            assert list(o.outputs[0].token_ids) == seq[len(ids) :], p


def test_eval_perplexity_cli_scores_the_chosen_head(tmp_path, gguf_tokenizer, capsys):
    """`tokenmill eval perplexity --quantize-lm-head` picks the head it scores: the checkpoint's own
    quantized head by default, the fp16 table with none; the two differ, and each equals the
    perplexity of load_model with the same choice."""
    from tokenmill.entrypoints.cli import main
    from tokenmill.eval.perplexity import evaluate_perplexity, wikitext2_ids

    model = make_tiny_model(vocab_size=gguf_tokenizer.vocab_size, hidden_size=64, head_dim=16, intermediate_size=128)
    qcfg = QuantConfig(method="rtn", bits=4, group_size=64, lm_head=True)
    report = quantize_model(model, qcfg, progress=False)
    out = save_quantized(model, model.config, gguf_tokenizer, report.weights, "gptq", tmp_path / "q", False)
    data = tmp_path / "wiki.jsonl"
    data.write_text(
        "\n".join(json.dumps({"text": f" The cat number {i} sat on the mat and looked around."}) for i in range(40))
        + "\n"
    )
    got = {}
    for head in ("checkpoint", "none"):
        assert (
            main(
                [
                    "eval",
                    "perplexity",
                    "--model",
                    str(out),
                    "--dataset",
                    str(data),
                    "--seqlen",
                    "64",
                    "--quantize-lm-head",
                    head,
                    "--json",
                ]
            )
            == 0
        )
        row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert row["lm_head"] == head
        got[head] = row["perplexity"]
        ref = load_model(str(out), quantize_lm_head=head)
        ids = wikitext2_ids(lambda s, ref=ref: ref.tokenizer.encode(s, add_special_tokens=False), data)
        assert row["perplexity"] == pytest.approx(evaluate_perplexity(ref.model, ids, 64, progress=False).perplexity)
    assert got["checkpoint"] != got["none"]
