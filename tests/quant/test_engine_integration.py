"""A quantized checkpoint runs through the whole engine (batching, chunked prefill, prefix cache)
and decodes exactly what a plain full-recompute greedy loop over the same quantized model decodes."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.llm import LLM
from tokenmill.models.loader import load_model
from tokenmill.quant.pipeline import QuantConfig, quantize_model
from tokenmill.quant.save import save_quantized
from tokenmill.sampling_params import SamplingParams


def _greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            t = torch.tensor(out)
            logits = model.compute_logits(model(t, torch.arange(len(out)))[-1:])
            out.append(int(logits.argmax(-1)))
    return out[len(ids) :]


@pytest.mark.parametrize(
    "arch_fixture,qcfg",
    [
        ("tiny_llama", QuantConfig(method="gptq", bits=4, group_size=32, desc_act=True)),
        ("tiny_qwen2", QuantConfig(method="awq", bits=4, group_size=32, awq_n_grid=5)),
    ],
)
def test_quantized_checkpoint_through_engine(request, tmp_path, arch_fixture, qcfg):
    src = request.getfixturevalue(arch_fixture)
    loaded = load_model(str(src), dtype=torch.float32)
    calib = torch.randint(3, loaded.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    report = quantize_model(loaded.model, qcfg, calib, progress=False)
    out = save_quantized(
        loaded.model,
        loaded.config,
        loaded.tokenizer,
        report.weights,
        qcfg.resolved_format,
        tmp_path / "q",
        qcfg.sym,
        qcfg.desc_act,
    )
    prompts = [
        "The quick brown fox jumps over",
        "The quick brown fox jumps over the lazy dog and",
        "Hello",
        "The quick brown fox",
    ]
    llm = LLM(
        model=str(out), dtype="float32", max_model_len=128, num_gpu_blocks_override=64, max_num_batched_tokens=16
    )  # small budget: prompts are chunked, decodes batched
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ref_model = load_model(str(out), dtype=torch.float32)
    for p, o in zip(prompts, outs):
        ids = ref_model.tokenizer.encode(p)
        assert list(o.outputs[0].token_ids) == _greedy(ref_model.model, ids, 8), p
