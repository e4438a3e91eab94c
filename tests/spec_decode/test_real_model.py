"""Speculative decoding on the default model (SmolLM2-135M): greedy identity for both proposers
and exactness of the rejection sampler on the real target distribution at one position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import isa_skip_reason
from tests.spec_decode.test_rejection_sampler import chisquare_pvalue
from tokenmill import LLM, SamplingParams, native
from tokenmill.layers import fused_ops
from tokenmill.spec_decode.rejection_sampler import rejection_sample

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "List the days of the week, then list them again in reverse order."}]


@pytest.fixture(scope="module")
def target():
    return LLM("smollm2-135m", max_num_batched_tokens=64, num_gpu_blocks_override=64)


# Pinned γ: this test is about identity while drafts are verified; whether speculation pays (and so
# whether adaptive γ turns it on for a 40-token reply) depends on the machine's speed at the moment.
@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
        {
            "method": "draft_model",
            "model": "smollm2-135m",
            "draft_num_layers": 8,
            "num_speculative_tokens": 3,
            "adaptive": False,
        },
    ],
)
def test_greedy_identical_on_the_real_model(target, spec):
    params = SamplingParams(temperature=0, max_tokens=40)
    ref = target.chat(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM("smollm2-135m", max_num_batched_tokens=64, num_gpu_blocks_override=64, speculative_config=spec)
    out = llm.chat(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    llm.check_integrity()
    assert out == ref
    stats = llm.stats().spec_decode
    assert stats["num_drafts"] > 0
    if spec["method"] == "ngram":  # the truncated self-draft of SmolLM2 agrees with it almost never (docs)
        assert stats["num_accepted_tokens"] > 0


# A kernel that sums a row in one order at 1 to 8 rows: VNNI or AMX (AVX512-BF16), or the AVX2 kernel, which
# serves every bf16 row count on an AVX2-only CPU.
_FEW_ROWS_INVARIANT = (
    fused_ops.pack_vnni(torch.zeros(64, 64, dtype=torch.bfloat16)) is not None or native.bf16_linears_batch_invariant()
)


@pytest.mark.skipif(
    not _FEW_ROWS_INVARIANT,
    reason=isa_skip_reason("bf16 identity (a few-row kernel that sums a row in one order)", "AVX512-BF16 or AVX2 only"),
)
@pytest.mark.parametrize("gamma", [2, 5])
def test_bf16_greedy_speculation_reproduces_plain_decoding(gamma):
    """In bf16 a near-tie flips when a token's logits are computed differently. Verification rows run
    through the same few-row kernel as a one-token decode step, summed in the same order (layers/
    fused_ops.dense_linear), so greedy speculation with up to 7 drafts must give plain decoding's
    tokens exactly, for several prompts and long enough replies to meet near-ties."""
    prompts = [
        [{"role": "user", "content": c}]
        for c in (
            "Explain how a bicycle gear system works, step by step.",
            "Write a Python function that checks whether a string is a palindrome, and explain it.",
            "What are three differences between a lake and a sea?",
        )
    ]
    params = SamplingParams(temperature=0, max_tokens=64)
    kw = dict(dtype="bfloat16", max_num_batched_tokens=64, num_gpu_blocks_override=128)
    plain = LLM("smollm2-135m", **kw)
    spec = LLM(
        "smollm2-135m", speculative_config={"method": "ngram", "num_speculative_tokens": gamma, "adaptive": False}, **kw
    )
    for p in prompts:
        ref = plain.chat(p, params, use_tqdm=False)[0].outputs[0].token_ids
        out = spec.chat(p, params, use_tqdm=False)[0].outputs[0].token_ids
        assert out == ref
    assert spec.stats().spec_decode["num_accepted_tokens"] > 0
    spec.check_integrity()


def test_rejection_sampler_exact_on_real_distributions(target):
    """Target p at the prompt's last position (temperature 0.8, top-k 40) against a q from the
    same logits at temperature 2 over the top 40 of a shifted position (a realistic, partly
    overlapping draft). Tokens outside both supports have p = q = 0: the test runs on their union."""
    eng = target.engine
    ids = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(PROMPT, True), add_special_tokens=False)
    with torch.inference_mode():
        x, pos = torch.tensor(ids), torch.arange(len(ids))
        logits = eng.model.compute_logits(eng.model(x, pos)[-2:])
        lp = logits[1] / 0.8
        lq = (logits[1] + logits[0]) / 2 / 2.0
    sup = torch.unique(torch.cat([lp.topk(40).indices, lq.topk(40).indices]))

    def dist(logits):
        kth = logits.topk(40).values[-1]
        return logits[sup].masked_fill(logits[sup] < kth, float("-inf")).softmax(-1)

    p, q = dist(lp), dist(lq)
    n, g = 50_000, torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    out = rejection_sample(
        p.log().repeat(2 * n, 1),
        drafts,
        q.repeat(n, 1),  # rows: draft, bonus per request
        [1] * n,
        torch.zeros(n, dtype=torch.bool),
        torch.rand(n, generator=g),
        torch.rand(n, generator=g, dtype=torch.float64),
    )
    counts = np.bincount([t[0] for t in out.output_token_ids], minlength=len(sup))
    accept = np.mean(out.num_accepted)
    assert 0.05 < accept < 0.995  # both the accept and the residual paths ran
    assert accept == pytest.approx(1 - 0.5 * float((p - q).abs().sum()), abs=0.01)
    expected = n * p.numpy()
    assert counts[expected == 0].sum() == 0
    assert chisquare_pvalue(counts[expected > 5], expected[expected > 5]) > 0.01


def test_tree_greedy_identical_on_the_real_model(target):
    params = SamplingParams(temperature=0, max_tokens=40)
    ref = target.chat(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False, "tree": {"max_nodes": 10}}
    llm = LLM("smollm2-135m", max_num_batched_tokens=64, num_gpu_blocks_override=64, speculative_config=spec)
    assert llm.chat(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == ref
    llm.check_integrity()
    stats = llm.stats().spec_decode
    assert stats["num_accepted_tokens"] > 0 and stats["mean_draft_size"] > 4


def test_tree_verification_follows_the_real_target(tmp_path):
    """The engine-level distribution test of token trees (tests/spec_decode/test_engine.py) at one position
    of the real model: three deterministic siblings, temperature 1, top-k 3. The file's weights dequantized: the
    check computes the target's top 3 by a prefill the engine's verification rows do not repeat bit for bit, and
    with int8 activations (the native GGUF path) a 0.045 gap between the third and fourth logit after one of
    the first tokens can flip."""
    from tests.spec_decode.test_engine import tree_distribution_check

    tree_distribution_check("smollm2-135m", [1, 20, 30, 40], 300, tmp_path, gguf_dequantize=True)
