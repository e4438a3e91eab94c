"""Speculative decoding inside the engine, on a tiny random Llama: greedy outputs are
token-identical to plain decoding (alone, in mixed batches, with chunked prefill, preemption and
prefix hits), limits hold, seeds reproduce, and sampled tokens follow the target distribution."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.spec_decode.test_rejection_sampler import chisquare_pvalue
from tokenmill import LLM, SamplingParams

# Repetitive prompts give the n-gram proposer something to match.
PROMPTS = [[1, 5, 6, 7, 8, 5, 6, 7] * 3, [10, 11, 12, 13, 14], list(range(100, 140)), [9, 9, 9, 9, 9, 9]]
TIGHT = dict(max_num_batched_tokens=8, num_gpu_blocks_override=18, block_size=4, max_num_seqs=4)


def spec_configs(path) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False, "prompt_lookup_min": 1},
        "draft_truncated": {
            "method": "draft_model",
            "model": str(path),
            "draft_num_layers": 1,
            "num_speculative_tokens": 3,
            "adaptive": False,
        },
        "draft_self": {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4, "adaptive": False},
        "ngram_adaptive": {"method": "ngram", "num_speculative_tokens": 5},
        "ngram_tree": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "adaptive": False,
            "prompt_lookup_min": 1,
            "tree": {"max_nodes": 6, "max_width": 3},
        },
        "ngram_tree_adaptive": {"method": "ngram", "num_speculative_tokens": 4, "tree": True},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False, "prompt_lookup_min": 2},
        "suffix_tree": {
            "method": "suffix",
            "num_speculative_tokens": 4,
            "adaptive": False,
            "tree": {"max_nodes": 6, "max_width": 2},
        },
    }


def run(llm: LLM, prompts, params) -> list[list[int]]:
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.check_integrity()
    return out


@pytest.fixture(scope="module")
def greedy_reference(tiny_llama):
    llm = LLM(str(tiny_llama), **TIGHT)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = run(llm, PROMPTS, params)
    assert llm.stats().num_preemptions > 0, "the tight pool must force preemption"
    return params, ref


@pytest.mark.parametrize(
    "name",
    [
        "ngram",
        "draft_truncated",
        "draft_self",
        "ngram_adaptive",
        "ngram_tree",
        "ngram_tree_adaptive",
        "suffix",
        "suffix_tree",
    ],
)
def test_greedy_identical_with_chunked_prefill_and_preemption(tiny_llama, greedy_reference, name):
    params, ref = greedy_reference
    llm = LLM(str(tiny_llama), speculative_config=spec_configs(tiny_llama)[name], **TIGHT)
    assert run(llm, PROMPTS, params) == ref  # mixed batch, tiny budget and pool
    assert run(llm, PROMPTS[:1], params) == ref[:1]  # alone (and now with prefix-cache hits)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    spec = stats.spec_decode  # drafts were made and verified (adaptive γ included): not plain decoding in disguise
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_accepted_tokens"]
    if name == "ngram_tree":  # trees were drafted (more nodes than depth) and some accepted
        assert spec["mean_draft_size"] > 3 and spec["num_accepted_tokens"] > 0
    if name.startswith("draft"):  # the draft model runs in its own runner's C++ layer loop, as the target does
        draft_loop = llm.engine.executor.runner.speculator.proposer.runner.decode_loop
        assert draft_loop is not None and draft_loop.steps_served > 0
    if name == "draft_self":  # the draft is the target: every draft token is accepted
        assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] > 0
        assert spec["mean_acceptance_length"] > 2
    if name.startswith("suffix"):  # the batch's text fed the online store, and the second run drafted from it
        online = llm.engine.executor.runner.speculator.proposer.online
        assert online.tenant_tokens_held(None) > 0 and online.stats(None).hits > 0


@pytest.mark.parametrize("name", ["draft_self", "ngram_tree"])
def test_limits_and_stop_tokens_hold(tiny_llama, greedy_reference, name):
    _, ref = greedy_reference
    cfg = spec_configs(tiny_llama)[name]
    # max_model_len: prompt 40 + 8 outputs = 48; drafts must never point past it.
    llm = LLM(str(tiny_llama), speculative_config=cfg, max_model_len=48, **TIGHT)
    out = run(llm, PROMPTS[2:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out == [ref[2][:8]]
    # max_tokens cuts even when all drafts are accepted; a stop token inside accepted drafts ends there.
    stop = ref[0][10]
    out = run(llm, PROMPTS[:1], [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)])
    assert out == [ref[0][:7]]
    out = run(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop]))
    assert out == [ref[0][: ref[0].index(stop) + 1]]


@pytest.mark.parametrize("name", ["draft_truncated", "ngram_tree"])
def test_mixed_sampling_batch_and_seeds(tiny_llama, greedy_reference, name):
    _, ref = greedy_reference
    cfg = spec_configs(tiny_llama)[name]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(
            temperature=1.0, top_k=20, frequency_penalty=0.5, seed=4, max_tokens=10, ignore_eos=True, logprobs=2
        ),
    ]
    a = run(LLM(str(tiny_llama), speculative_config=cfg, **TIGHT), PROMPTS, params)
    b = run(LLM(str(tiny_llama), speculative_config=cfg, **TIGHT), PROMPTS, params)
    assert a == b  # seeded sampling reproduces
    assert a[0] == ref[0] and a[2] == ref[2]
    assert len(a[1]) == len(a[3]) == 10


def test_logprobs_cover_every_emitted_token(tiny_llama):
    cfg = spec_configs(tiny_llama)["draft_self"]
    llm = LLM(str(tiny_llama), speculative_config=cfg, **TIGHT)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    spec = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    base = LLM(str(tiny_llama), **TIGHT).generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert len(spec.logprobs) == len(spec.token_ids) == 12
    for s, b, t in zip(spec.logprobs, base.logprobs, spec.token_ids):
        assert s[t].rank == b[t].rank == 1 and s[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


@pytest.fixture(scope="module")
def perturbed_draft(tiny_llama, tmp_path_factory):
    """A separate checkpoint close to the target (weights + noise): its top tokens overlap the
    target's with different probabilities, so drafts are accepted and rejected."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("draft")
    for f in tiny_llama.iterdir():
        shutil.copy(f, path / f.name)
    g = torch.Generator().manual_seed(0)
    for f in path.glob("*.safetensors"):
        w = load_file(f)
        save_file(
            {k: v + 0.003 * torch.randn(v.shape, generator=g) for k, v in w.items()}, f, metadata={"format": "pt"}
        )
    return path


def test_sampled_tokens_follow_the_target(tiny_llama, perturbed_draft):
    """Temperature 1, top-k 3: the token after t1 is verified against a separate draft checkpoint
    (one draft token, pinned γ); grouped by t1, its counts must match the target's distribution."""
    cfg = {"method": "draft_model", "model": str(perturbed_draft), "num_speculative_tokens": 1, "adaptive": False}
    llm = LLM(str(tiny_llama), speculative_config=cfg, max_num_seqs=64, dtype="float32")  # the oracle's dtype
    prompt = [1, 20, 30, 40]
    n = 200
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)]
    outs = run(llm, [prompt] * n, params)
    spec = llm.stats().spec_decode
    assert spec["num_drafts"] >= n and 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
    model = llm.engine.model
    groups: dict[int, list[int]] = {}
    for o in outs:
        groups.setdefault(o[0], []).append(o[1])
    for t1, seconds in groups.items():
        if len(seconds) < 30:
            continue
        with torch.inference_mode():
            ids = torch.tensor(prompt + [t1])
            logits = model.compute_logits(model(ids, torch.arange(len(ids)))[-1:])[0]
        top = logits.topk(3)
        p = np.zeros(logits.shape[0])
        p[top.indices.numpy()] = top.values.softmax(-1).numpy()
        counts = np.bincount(seconds, minlength=len(p))
        assert counts[p == 0].sum() == 0
        assert chisquare_pvalue(counts[p > 0], len(seconds) * p[p > 0]) > 0.01


def branching_tree_config(store: Path, references: list[list[int]]) -> dict:
    """An n-gram tree config over a datastore (written to `store`) whose most frequent continuation of every
    4-token context of the reference sequences (prompt + greedy output) is wrong and whose second is right:
    every accepted path runs through later siblings, so its K/V must be moved into place."""
    from tokenmill.spec_decode.datastore import SuffixDatastore

    seqs = []
    for full in references:
        seqs.append(full)
        for i in range(4, len(full)):
            seqs += [full[i - 4 : i] + [(full[i] + 1) % 256]] * 2
    SuffixDatastore.save(store, seqs, min_n=2, max_n=4)
    return {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "adaptive": False,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 2,
        "datastore": str(store),
        "datastore_min_share": 0.0,
        "tree": {"max_nodes": 8, "max_width": 2},
    }


def test_tree_branches_past_the_first_child(tiny_llama, greedy_reference, tmp_path):
    """A datastore whose most frequent continuation of every reference context is wrong and whose second is
    right: every accepted path runs through later siblings, so its K/V must be moved into place for the
    output to stay the plain decode's (the runner counts those moves)."""
    params, ref = greedy_reference
    cfg = branching_tree_config(tmp_path / "store.npz", [p + o for p, o in zip(PROMPTS, ref)])
    llm = LLM(str(tiny_llama), speculative_config=cfg, **TIGHT)
    assert run(llm, PROMPTS, params) == ref
    assert llm.engine.executor.runner.num_paths_compacted > 0
    assert llm.stats().spec_decode["num_accepted_tokens"] > 0


def _target_topk(model, ids: list[int], k: int) -> tuple[list[int], np.ndarray]:
    """The target's top-k tokens after ids and the full distribution renormalised over them."""
    with torch.inference_mode():
        t = torch.tensor(ids)
        logits = model.compute_logits(model(t, torch.arange(len(t)))[-1:])[0]
    top = logits.topk(k)
    p = np.zeros(logits.shape[0])
    p[top.indices.numpy()] = top.values.softmax(-1).numpy()
    return top.indices.tolist(), p


def second_tokens_follow_the_target(model, prompt: list[int], outs: list[list[int]]) -> int:
    """Outputs sampled at temperature 1, top-k 3 after `prompt`, grouped by their first token: in every group of
    30 or more, the second tokens follow the target's distribution (chi-square). Returns the groups checked."""
    groups: dict[int, list[int]] = {}
    for o in outs:
        groups.setdefault(o[0], []).append(o[1])
    checked = 0
    for t1, seconds in groups.items():
        if len(seconds) < 30:
            continue
        _, p = _target_topk(model, prompt + [t1], 3)
        counts = np.bincount(seconds, minlength=len(p))
        assert counts[p == 0].sum() == 0
        assert chisquare_pvalue(counts[p > 0], len(seconds) * p[p > 0]) > 0.01
        checked += 1
    return checked


MIXED_PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, presence_penalty=0.5, seed=4, max_tokens=12, ignore_eos=True),
]
"""Greedy and seeded sampled rows in one batch (the seeded-reproduction tests of the trained proposers)."""


def tree_distribution_check(model_path: str, prompt: list[int], n: int, tmp_path, **llm_kwargs) -> None:
    """Temperature 1, top-k 3. A datastore offers, after the prompt and each likely first token t1, the
    target's own top-3 second tokens (in the reverse of the target's order, with unequal shares) and one
    continuation of each: a tree of deterministic siblings two levels deep at the position after t1.
    Grouped by t1, the second tokens must follow the target's distribution."""
    from tokenmill.spec_decode.datastore import SuffixDatastore

    plain = LLM(model_path, dtype="float32", **llm_kwargs)
    model = plain.engine.model
    firsts, _ = _target_topk(model, prompt, 3)
    seqs = []
    for t1 in firsts:
        seconds, _ = _target_topk(model, prompt + [t1], 3)
        for rank, t2 in enumerate(reversed(seconds)):
            seqs += [prompt[-3:] + [t1, t2, (t2 + 7) % 256]] * (rank + 1)
    store = tmp_path / "dist.npz"
    SuffixDatastore.save(store, seqs, min_n=2, max_n=4)
    cfg = {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "adaptive": False,
        "prompt_lookup_min": 4,
        "prompt_lookup_max": 4,
        "datastore": str(store),
        "datastore_min_share": 0.0,
        "tree": {"max_nodes": 6, "max_width": 3},
    }
    llm = LLM(model_path, speculative_config=cfg, max_num_seqs=64, dtype="float32", **llm_kwargs)
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)]
    outs = run(llm, [prompt] * n, params)
    spec = llm.stats().spec_decode
    assert spec["num_drafts"] >= n // 2 and spec["mean_draft_size"] > 2
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
    assert second_tokens_follow_the_target(model, prompt, outs) >= 1


def test_tree_sampled_tokens_follow_the_target(tiny_llama, tmp_path):
    tree_distribution_check(str(tiny_llama), [1, 20, 30, 40], 300, tmp_path)
