"""Model numerics against Hugging Face transformers (the oracle), through our paged runner."""

from __future__ import annotations

import pytest
import torch

from tokenmill.attention.metadata import forward_context
from tokenmill.config import CacheConfig, KVCacheSpec, SchedulerConfig, plan_kv_groups
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.step_io import StepTokens
from tokenmill.models.loader import load_model
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.model_runner import ModelRunner

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a dragon who",
    "1, 2, 3, 4,",
    "Photosynthesis is the process by which green plants",
    "Q: What is the boiling point of water?\nA:",
    "The quick brown fox",
    "In 1969, Neil Armstrong became the first person to",
]


def paged_logits(
    loaded,
    prompts_ids: list[list[int]],
    chunk: int,
    block_size: int = 4,
    num_blocks: int = 256,
    sched_out: list | None = None,
) -> list[torch.Tensor]:
    """All-token logits for several prompts computed in mixed paged steps: each step every
    request computes up to `chunk` new tokens (a request with 1 token left decodes). sched_out: gets the
    scheduler (its KV manager's counters)."""
    arch = loaded.config
    groups = plan_kv_groups(arch.layer_windows())  # one for Llama; Gemma 3: global + sliding-window groups
    spec = KVCacheSpec(
        num_blocks,
        block_size,
        len(groups[0].layers),
        arch.num_key_value_heads,
        arch.head_dim,
        next(loaded.model.parameters()).dtype,
        tuple(groups) if len(groups) > 1 else (),
    )
    runner = ModelRunner(loaded.model, arch, spec, torch.device("cpu"))
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=10_000),
        CacheConfig(block_size=block_size, enable_prefix_caching=False),
        num_blocks,
        10_000,
        kv_groups=groups if len(groups) > 1 else None,
    )
    reqs = [Request(str(i), ids, SamplingParams(max_tokens=1), 2, 1) for i, ids in enumerate(prompts_ids)]
    out = [[] for _ in reqs]
    for r in reqs:
        sched.add_request(r)
    # admit everyone, then step manually with per-request chunk sizes
    while any(r.num_computed_tokens < r.num_tokens for r in reqs):
        step: list[StepTokens] = []
        for r in reqs:
            n = min(chunk, r.num_tokens - r.num_computed_tokens)
            if n == 0:
                continue
            if r.request_id not in sched.kv.req_blocks:
                sched.kv.allocate_slots(r, 0)
            assert sched.kv.allocate_slots(r, n) is not None
            start = r.num_computed_tokens
            tables = sched.kv.get_group_block_ids(r.request_id)
            step.append(
                StepTokens(
                    r.request_id, start, r.all_token_ids[start : start + n], tables[0], group_block_ids=tables[1:]
                )
            )
        batch = sorted(step, key=lambda s: s.num_new_tokens != 1)
        inp = runner.prepare_inputs(batch)
        with torch.inference_mode(), forward_context(inp.meta, inp.group_metas):
            hidden = loaded.model(inp.input_ids, inp.positions)
            logits = loaded.model.compute_logits(hidden)
        pos = 0
        for s in batch:
            i = int(s.request_id)
            out[i].append(logits[pos : pos + s.num_new_tokens])
            pos += s.num_new_tokens
            reqs[i].num_computed_tokens += s.num_new_tokens
    if sched_out is not None:
        sched_out.append(sched)
    return [torch.cat(o) for o in out]


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """HF greedy decoding that, like ignore_eos, neither stops at nor suppresses EOS."""
    hf_model.generation_config.eos_token_id = None
    return hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)[
        0, len(ids) :
    ].tolist()


@pytest.fixture(scope="module")
def real_pair(real_model_path):
    """Our model and transformers' on the same GGUF file, both dequantized at load: the float model path against
    its oracle (the file run natively, in its blocks, is checked against this path in
    tests/quant/test_gguf_native.py)."""
    transformers = pytest.importorskip("transformers")
    ours = load_model(str(real_model_path), dtype=torch.float32, gguf_dequantize=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(real_model_path.parent), gguf_file=real_model_path.name, dtype=torch.float32
    )
    hf.eval()
    return ours, hf


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1000, 5])
def test_real_model_logits_match_hf(real_pair, chunk):
    ours, hf = real_pair
    ids = [ours.tokenizer.encode(p) for p in PROMPTS]
    got = paged_logits(ours, ids, chunk=chunk)
    for g, i in zip(got, ids):
        diff = (g - hf_logits(hf, i)).abs().max().item()
        assert diff <= 1e-3, f"max abs diff {diff}"


@pytest.mark.slow
def test_real_model_greedy_matches_hf(real_pair, real_model_path):
    from tokenmill import LLM

    ours, hf = real_pair
    llm = LLM(model=str(real_model_path), dtype="float32", kv_cache_memory_bytes=64 << 20, gguf_dequantize=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_greedy(hf, ids, 64)
        assert out.outputs[0].token_ids == ref, prompt
    llm.check_integrity()


@pytest.mark.parametrize("arch_fixture", ["tiny_llama", "tiny_qwen2"])
def test_tiny_models_match_hf(request, arch_fixture):
    transformers = pytest.importorskip("transformers")
    path = request.getfixturevalue(arch_fixture)
    ours = load_model(str(path), dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert_matches_hf(ours, hf, path, PROMPTS[:5], 24, arch_fixture)


def assert_matches_hf(ours, hf, path, prompts: list[str], max_tokens: int, what: str):
    """Logits within 1e-3 of HF's, whole prompts and 3-token chunks; greedy tokens identical. Returns the LLM."""
    ids = [ours.tokenizer.encode(p) for p in prompts]
    for chunk in (1000, 3):
        got = paged_logits(ours, ids, chunk=chunk)
        for g, i in zip(got, ids):
            diff = (g - hf_logits(hf, i)).abs().max().item()
            assert diff <= 1e-3, f"{what} chunk={chunk}: max abs diff {diff}"
    from tokenmill import LLM

    llm = LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=16 << 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    for i, out in zip(ids, outs):
        with torch.no_grad():
            ref = hf_greedy(hf, i, max_tokens)
        assert out.outputs[0].token_ids == ref
    llm.check_integrity()
    return llm


def test_qwen2_has_biases(tiny_qwen2):
    ours = load_model(str(tiny_qwen2))
    assert ours.config.attention_bias
    assert ours.model.model.layers[0].self_attn.qkv_proj.bias is not None


@pytest.mark.parametrize("arch_fixture", ["tiny_qwen3", "tiny_llama3"])
def test_qwen3_and_llama3_checkpoints_match_hf(request, arch_fixture):
    """Qwen3 (QK-norm, no biases, head_dim 24 != 64 / 4) and Llama 3 (rope scaling "llama3"): logits of 8
    prompts within 1e-3 of transformers' in float32, whole and in 3-token chunks; 64 greedy tokens identical."""
    transformers = pytest.importorskip("transformers")
    path = request.getfixturevalue(arch_fixture)
    ours = load_model(str(path), dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if arch_fixture == "tiny_qwen3":
        attn = ours.model.model.layers[0].self_attn
        assert attn.head_dim == 24 and attn.qkv_proj.bias is None and attn.q_norm.weight.shape == (24,)
    else:
        # transformers 5 writes theta and scaling as "rope_parameters": both must arrive
        assert ours.config.rope_scaling["rope_type"] == "llama3" and ours.config.rope_theta == 500000.0
    llm = assert_matches_hf(ours, hf, path, PROMPTS, 64, arch_fixture)
    loop = llm.engine.executor.runner.decode_loop  # QK-norm is a layout field: the C++ loop serves Qwen3 too
    assert loop is not None and loop.steps_served > 0
