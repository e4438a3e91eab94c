"""The C++ layer loop (worker/cpu_decode.py, csrc/decode_stack.cpp) against the module path that defines
the layer: same tokens, with the loop's own counters proving it served the steps."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import isa_skip_reason
from tokenmill import LLM, SamplingParams, native
from tokenmill.attention.metadata import TILED_PREFILL_MIN_TOKENS
from tokenmill.layers.linear import ANY_ROWS, KernelKind
from tokenmill.models.loader import load_model
from tokenmill.quant import cpu_int4
from tokenmill.quant.pipeline import QuantConfig, quantize_model
from tokenmill.quant.save import save_quantized

PROMPTS = [[5, 9, 200, 31, 7], [1, 2, 3], list(range(40, 75))]


def generate_both_ways(llm: LLM, prompts=PROMPTS, n: int = 24) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens with the loop, then with the module path only (the runner's loop switched off)."""
    runner = llm.engine.executor.runner
    loop = runner.decode_loop
    assert loop is not None
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    before = loop.steps_served
    fast = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    assert loop.steps_served - before >= n - 1  # the loop really served the decode steps
    runner.decode_loop = None
    slow = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    runner.decode_loop = loop
    return fast, slow


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loop_matches_module_path(tiny_llama, dtype):
    llm = LLM(
        model=str(tiny_llama), dtype=dtype, max_model_len=256, num_gpu_blocks_override=64, enable_prefix_caching=False
    )
    assert llm.engine.executor.runner.decode_loop.max_rows == ANY_ROWS  # dense kernels: any step size
    fast, slow = generate_both_ways(llm)
    assert fast == slow
    assert llm.engine.executor.runner.decode_loop.max_tokens_served >= len(
        PROMPTS
    )  # batched decodes, not one at a time


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_single_stream_matches_module_path(tiny_llama, dtype):
    llm = LLM(
        model=str(tiny_llama), dtype=dtype, max_model_len=256, num_gpu_blocks_override=64, enable_prefix_caching=False
    )
    fast, slow = generate_both_ways(llm, [PROMPTS[2]])
    assert fast == slow


def test_loop_serves_a_batch_of_twenty(tiny_llama):
    """Above the old 8-row limit: 20 decodes in one step still run in the loop (AMX or not, the dense rule
    is one C++ function for both forwards)."""
    llm = LLM(
        model=str(tiny_llama),
        dtype="bfloat16",
        max_model_len=256,
        num_gpu_blocks_override=128,
        enable_prefix_caching=False,
    )
    prompts = [[3 + i, 17, 40 + i] for i in range(20)]
    fast, slow = generate_both_ways(llm, prompts, n=8)
    assert fast == slow
    assert llm.engine.executor.runner.decode_loop.max_tokens_served >= 20


LONG_PROMPTS = [list(range(10, 100)), list(range(200, 240)), [5, 6, 7]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loop_serves_prompt_chunks_where_prompts_are_attended_per_token(tiny_llama, dtype):
    """batch_invariant: prompt chunks are attended token by token, so a step that mixes a 40-token chunk with
    running decodes is one the loop can run too; it does, and gives the module path's tokens."""
    llm = LLM(
        model=str(tiny_llama),
        dtype=dtype,
        max_model_len=256,
        num_gpu_blocks_override=64,
        enable_prefix_caching=False,
        batch_invariant=True,
        max_num_batched_tokens=48,
    )
    fast, slow = generate_both_ways(llm, LONG_PROMPTS, n=16)
    assert fast == slow
    assert llm.engine.executor.runner.decode_loop.max_tokens_served >= TILED_PREFILL_MIN_TOKENS


@pytest.fixture(scope="module")
def tiny_llama_d64(tmp_path_factory, gguf_tokenizer):
    """A tiny Llama with head_dim 64, a size the tiled prefill kernel serves."""
    from tests.conftest import write_tiny_checkpoint

    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_d64"),
        "llama",
        gguf_tokenizer,
        seed=5,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def test_loop_serves_tiled_prompt_chunks(tiny_llama_d64, each_isa):
    """Without per-token prompt attention, chunks of 16+ tokens take the tiled kernel; the loop runs that kernel
    too (with the decodes and short chunks of the same step per token), so those steps stay in the loop and give
    the module path's tokens. Where the tiled kernel does not serve (no AVX512-BF16), they go to the module path."""
    llm = LLM(
        model=str(tiny_llama_d64),
        dtype="bfloat16",
        max_model_len=256,
        num_gpu_blocks_override=64,
        enable_prefix_caching=False,
        batch_invariant=False,
        max_num_batched_tokens=48,
    )
    loop = llm.engine.executor.runner.decode_loop
    fast, slow = generate_both_ways(llm, LONG_PROMPTS, n=16)
    assert fast == slow
    if native.has_avx512_bf16():
        assert loop.tiles_prompts and loop.tiled_steps_served >= 3  # 90 + 40 prompt tokens in 48-token steps
        assert loop.max_tokens_served >= TILED_PREFILL_MIN_TOKENS
    else:
        assert not loop.tiles_prompts and loop.tiled_steps_served == 0
        assert loop.max_tokens_served < TILED_PREFILL_MIN_TOKENS


@pytest.mark.parametrize("bits,group_size,kind", [(4, 32, None), (8, -1, KernelKind.INT8)])
def test_loop_matches_module_path_quantized(tiny_llama, tmp_path, bits, group_size, kind):
    loaded = load_model(str(tiny_llama), dtype=torch.float32)
    qcfg = QuantConfig(method="rtn", bits=bits, group_size=group_size)
    report = quantize_model(loaded.model, qcfg, None, progress=False)
    out = save_quantized(
        loaded.model, loaded.config, loaded.tokenizer, report.weights, qcfg.resolved_format, tmp_path / "q", qcfg.sym
    )
    llm = LLM(
        model=str(out),
        dtype="bfloat16",
        max_model_len=256,
        num_gpu_blocks_override=64,
        enable_prefix_caching=False,
        quantize_lm_head="none",
    )
    model = llm.engine.model
    if kind is KernelKind.INT8 and not cpu_int4.available():  # the int8 kernel is AVX2 / AVX512-BF16 code
        assert llm.engine.executor.runner.decode_loop is None
        pytest.skip(isa_skip_reason("the int8 C++ decode loop", "AVX2"))
    kinds = {
        lin.kernel().kind
        for layer in model.decoder_layout().layers
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    }
    if kind is not None:
        assert kind in kinds
    fast, slow = generate_both_ways(llm)
    assert fast == slow
    fast, slow = generate_both_ways(llm, [PROMPTS[0]])
    assert fast == slow


def test_loop_serves_biases_and_declines_int8_kv(tiny_qwen2, tiny_llama):
    """Qwen2's q/k/v biases go through the dense rule in both forwards; an int8 KV cache runs the module path."""
    llm = LLM(model=str(tiny_qwen2), dtype="bfloat16", max_model_len=128, num_gpu_blocks_override=32)
    assert llm.engine.executor.runner.decode_loop is not None
    fast, slow = generate_both_ways(llm, [[5, 6, 7, 8]], n=12)
    assert fast == slow
    llm = LLM(model=str(tiny_llama), max_model_len=128, num_gpu_blocks_override=32, kv_cache_dtype="int8")
    assert llm.engine.executor.runner.decode_loop is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_gemma3"])
def test_every_family_runs_in_the_loop(request, arch, dtype, each_isa):
    """One loop, every family's layout as data (models/interface.py): Llama, Qwen2 (q/k/v biases), Qwen3 (QK-norm,
    head_dim 24) and Gemma 3 (four 1 + w norms, GeGLU, scaled embedding, two RoPE bases, 8-token windows over six
    KV-cache groups) give the module path's greedy tokens, with the loop serving the decode steps, at every ISA
    level this host has. The 35-token prompt passes Gemma's window, so windowed layers attend from key_start over
    tables whose first blocks slid out."""
    llm = LLM(
        model=str(request.getfixturevalue(arch)),
        dtype=dtype,
        max_model_len=256,
        num_gpu_blocks_override=128,
        enable_prefix_caching=False,
    )
    loop = llm.engine.executor.runner.decode_loop
    assert loop is not None
    fast, slow = generate_both_ways(llm)
    assert fast == slow
    assert loop.max_tokens_served >= len(PROMPTS)  # batched decodes
    if arch == "tiny_gemma3":
        assert loop.num_kv_groups == 6 and llm.stats().num_blocks_slid_out > 0
