"""Greedy outputs are token-identical across batching, chunked prefill and preemption."""

from __future__ import annotations

import json

import pytest

from tests.conftest import SHARED_DATA
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def mixed_prompts(n: int) -> list[str]:
    """Real chat prompts of varied length from the ShareGPT file, plus short ones."""
    rows = []
    with open(SHARED_DATA / "sharegpt_v3_first_exchange_5000.jsonl") as f:
        for line in f:
            text = json.loads(line)["conversations"][0]["value"]
            if 5 < len(text) < 600:
                rows.append(text)
            if len(rows) >= n:
                break
    return rows


@pytest.fixture(scope="module")
def llm():
    return LLM(
        dtype="float32",
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=2048,
        max_num_seqs=32,
        enable_prefix_caching=False,
    )


@pytest.fixture(scope="module")
def reference(llm):
    prompts = mixed_prompts(16)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.check_integrity()
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_alone_vs_batch_of_16(llm, reference):
    prompts, batched = reference
    for i in (0, 7, 15):
        alone = llm.generate([prompts[i]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert alone == batched[i]
    llm.check_integrity()


@pytest.mark.slow
def test_chunked_prefill_tiny_budget(reference):
    prompts, batched = reference
    llm = LLM(
        dtype="float32",
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=8,
        max_num_seqs=32,
        enable_prefix_caching=False,
    )
    outs = llm.generate(prompts[:6], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == batched[:6]
    llm.check_integrity()


@pytest.mark.slow
def test_preemption_same_output(reference):
    prompts, batched = reference
    # 24 blocks of 16 tokens = 384 token slots for 8 requests of up to ~150 + 24 tokens each.
    llm = LLM(
        dtype="float32",
        num_gpu_blocks_override=24,
        max_num_batched_tokens=512,
        max_num_seqs=32,
        enable_prefix_caching=False,
    )
    idx = [i for i, p in enumerate(prompts) if len(llm.tokenizer.encode(p)) + 24 <= 24 * 16][:8]
    outs = llm.generate([prompts[i] for i in idx], GREEDY, use_tqdm=False)
    assert llm.stats().num_preemptions > 0, "the pool was meant to be too small"
    assert [o.outputs[0].token_ids for o in outs] == [batched[i] for i in idx]
    llm.check_integrity()
