"""bf16 greedy outputs are token-identical across batching, chunked prefill, prefix hits, preemption and
speculation (ModelConfig.batch_invariant): the bf16 counterpart of test_equivalence.py. It holds where
the dense bf16 linears are batch-invariant (native.bf16_linears_batch_invariant): on AMX CPUs (AMX tiles at
any row count) and on AVX2-only CPUs (our AVX2 kernel at any row count; oneDNN has no bf16 path there),
docs/native_kernels.md. On AVX-512 without AMX, bf16 rows past the few-row kernel go to oneDNN, bf16 is not
claimed invariant, and the module skips, saying so."""

from __future__ import annotations

import pytest

from tests.conftest import isa_skip_reason
from tests.e2e.test_equivalence import mixed_prompts
from tokenmill import LLM, SamplingParams, native

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not native.bf16_linears_batch_invariant(),
        reason=isa_skip_reason("bf16 batch invariance", "AMX-BF16 or an AVX2-only CPU"),
    ),
]

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# the dense bf16 linears are the claim here: the default GGUF file dequantized (its native kernels are invariant
# everywhere, tests/quant/test_gguf_native.py)
BF16 = dict(dtype="bfloat16", max_num_seqs=32, gguf_dequantize=True)


@pytest.fixture(scope="module")
def reference():
    prompts = mixed_prompts(16)
    llm = LLM(**BF16, kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=2048, enable_prefix_caching=False)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    alone = {i: llm.generate([prompts[i]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for i in (0, 7, 15)}
    llm.check_integrity()
    return prompts, outs, alone


def test_alone_vs_batch_of_16(reference):
    _, batched, alone = reference
    assert all(alone[i] == batched[i] for i in alone)


def test_chunked_prefill_tiny_budget_in_a_mixed_batch(reference):
    prompts, batched, _ = reference
    llm = LLM(**BF16, kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=8, enable_prefix_caching=False)
    outs = llm.generate(prompts[:6], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == batched[:6]
    llm.check_integrity()


def test_prefix_hit_vs_cold(reference):
    prompts, batched, _ = reference
    llm = LLM(**BF16, kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=512, enable_prefix_caching=True)
    cold = llm.generate(prompts[:8], GREEDY, use_tqdm=False)
    hits_before = llm.stats().prefix_cache_hits
    warm = llm.generate(prompts[:8], GREEDY, use_tqdm=False)
    assert llm.stats().prefix_cache_hits > hits_before, "the second pass was meant to hit the prefix cache"
    assert [o.outputs[0].token_ids for o in cold] == batched[:8]
    assert [o.outputs[0].token_ids for o in warm] == batched[:8]
    llm.check_integrity()


def test_preempted_vs_not(reference):
    prompts, batched, _ = reference
    llm = LLM(**BF16, num_gpu_blocks_override=24, max_num_batched_tokens=512, enable_prefix_caching=False)
    idx = [i for i, p in enumerate(prompts) if len(llm.tokenizer.encode(p)) + 32 <= 24 * 16][:8]
    outs = llm.generate([prompts[i] for i in idx], GREEDY, use_tqdm=False)
    assert llm.stats().num_preemptions > 0, "the pool was meant to be too small"
    assert [o.outputs[0].token_ids for o in outs] == [batched[i] for i in idx]
    llm.check_integrity()


@pytest.mark.parametrize("gamma", [2, 5])
def test_ngram_speculation_vs_plain(reference, gamma):
    prompts, batched, _ = reference
    llm = LLM(
        **BF16,
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": gamma},
    )
    outs = llm.generate(prompts[:8], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == batched[:8]
    llm.check_integrity()


@pytest.mark.parametrize("source", ["ngram", "datastore"])
def test_tree_speculation_vs_plain(reference, tmp_path, source):
    """Token trees (pinned, 12 nodes): nodes attend through the key mask and accepted paths are moved into
    place, and the tokens stay plain decoding's. The datastore's first guess at every context of the reference
    answers is wrong and its second right, so accepted paths run through later siblings."""
    from tokenmill.spec_decode.datastore import SuffixDatastore

    prompts, batched, _ = reference
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False, "tree": {"max_nodes": 12}}
    if source == "datastore":
        seqs = []
        for out in batched[:8]:
            seqs.append(out)
            seqs += [out[i - 4 : i] + [(out[i] + 1) % 49152] for i in range(4, len(out)) for _ in range(2)]
        SuffixDatastore.save(tmp_path / "ds.npz", seqs, min_n=2, max_n=4)
        spec.update(datastore=str(tmp_path / "ds.npz"), datastore_min_share=0.0, prompt_lookup_min=2)
    llm = LLM(
        **BF16,
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        speculative_config=spec,
    )
    outs = llm.generate(prompts[:8], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == batched[:8]
    assert llm.stats().spec_decode["num_accepted_tokens"] > 0
    if source == "datastore":
        assert llm.engine.executor.runner.num_paths_compacted > 0
    llm.check_integrity()
