"""The flat CPU decode loop (worker/cpu_decode.py) against the module path it shortcuts."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import fused_ops
from tokenmill.quant.pipeline import QuantConfig, quantize_model
from tokenmill.quant.save import save_quantized
from tokenmill.models.loader import load_model
from tokenmill.worker import cpu_decode


PROMPTS = [[5, 9, 200, 31, 7], [1, 2, 3], list(range(40, 75))]


def generate_both_ways(llm: LLM, n: int = 24) -> tuple[list[list[int]], list[list[int]]]:
    runner = llm.engine.runner
    assert runner.decode_loop is not None
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    calls = {"n": 0}
    loop = runner.decode_loop
    orig = loop.__call__

    class Counting:
        def serves(self, meta, ids):
            return loop.serves(meta, ids)

        def __call__(self, *a):
            calls["n"] += 1
            return orig(*a)

    runner.decode_loop = Counting()
    fast = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                          use_tqdm=False)]
    assert calls["n"] > 0  # the loop really served decode steps
    runner.decode_loop = None
    slow = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                          use_tqdm=False)]
    runner.decode_loop = loop
    return fast, slow


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loop_matches_module_path(tiny_llama, dtype):
    llm = LLM(model=str(tiny_llama), dtype=dtype, max_model_len=256, num_gpu_blocks_override=64,
              enable_prefix_caching=False)
    fast, slow = generate_both_ways(llm)
    assert fast == slow


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpp_layer_loop_matches_module_path(tiny_llama, dtype, monkeypatch):
    """A single stream takes the C++ layer loop (one call per step)."""
    llm = LLM(model=str(tiny_llama), dtype=dtype, max_model_len=256, num_gpu_blocks_override=64,
              enable_prefix_caching=False)
    assert llm.engine.runner.decode_loop._stack is not None
    calls = {"n": 0}
    real = cpu_decode._stack_ext

    def counting():
        calls["n"] += 1
        return real()
    monkeypatch.setattr(cpu_decode, "_stack_ext", counting)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fast = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert calls["n"] >= 23
    llm.engine.runner.decode_loop = None
    slow = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert fast == slow


@pytest.mark.parametrize("bits,group_size,kind", [(4, 32, None), (8, -1, 4)])
def test_loop_matches_module_path_quantized(tiny_llama, tmp_path, bits, group_size, kind):
    loaded = load_model(str(tiny_llama), dtype=torch.float32)
    qcfg = QuantConfig(method="rtn", bits=bits, group_size=group_size)
    report = quantize_model(loaded.model, qcfg, None, progress=False)
    out = save_quantized(loaded.model, loaded.config, loaded.tokenizer, report.weights, qcfg.resolved_format,
                         tmp_path / "q", qcfg.sym)
    llm = LLM(model=str(out), dtype="bfloat16", max_model_len=256, num_gpu_blocks_override=64,
              enable_prefix_caching=False, quantize_lm_head="none")
    fast, slow = generate_both_ways(llm)
    assert fast == slow
    runner = llm.engine.runner
    loop = runner.decode_loop
    assert loop._stack is not None and loop._stack_multi  # quantized layers run in the C++ layer loop too
    if kind is not None:
        assert kind in loop._stack[1]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0].token_ids
    runner.decode_loop = None
    ref = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0].token_ids
    runner.decode_loop = loop
    assert one == ref


def test_loop_declines_biases_and_int8_kv(tiny_qwen2, tiny_llama):
    assert LLM(model=str(tiny_qwen2), max_model_len=128, num_gpu_blocks_override=32).engine.runner.decode_loop is None
    llm = LLM(model=str(tiny_llama), max_model_len=128, num_gpu_blocks_override=32, kv_cache_dtype="int8")
    assert llm.engine.runner.decode_loop is None


def test_cpp_layer_loop_serves_small_batches(tiny_llama, monkeypatch):
    """Steps of a few tokens on bf16 weights (here 3 decodes at once) also run in the C++ loop, with
    each linear's kernel chosen as the Python loop chooses it, so tokens match the module path."""
    llm = LLM(model=str(tiny_llama), dtype="bfloat16", max_model_len=256, num_gpu_blocks_override=64,
              enable_prefix_caching=False)
    assert llm.engine.runner.decode_loop._stack_multi
    sizes: list[int] = []
    real = cpu_decode._stack_ext()

    class Spy:
        def decode_stack(self, h, *args):
            sizes.append(h.shape[0])
            return real.decode_stack(h, *args)
    monkeypatch.setattr(cpu_decode, "_stack_ext", lambda: Spy())
    fast, slow = generate_both_ways(llm)
    assert max(sizes) == len(PROMPTS)
    assert fast == slow
