"""Tensor parallelism across real processes (torch.distributed gloo on 127.0.0.1): greedy float32 tokens of
TP = N equal TP = 1 on a tiny model and on the default model, through batching, chunked prefill and
preemption; the collectives really run; a size that does not divide the heads is refused by name."""

from __future__ import annotations

import pytest

from tests.distributed.test_disaggregation import drain, prompts

# the spec_decode tests' trained heads (importing a module's fixtures is how pytest shares them)
from tests.spec_decode.test_eagle import corpus, trained_head  # noqa: F401
from tests.spec_decode.test_medusa import medusa_corpus, trained_medusa  # noqa: F401
from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.distributed.tensor_parallel import check_tensor_parallel
from tokenmill.engine.core import EngineCore
from tokenmill.worker.tp_executor import TPExecutor

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def run(path, ps, tp, params=GREEDY, **kw):
    e = EngineCore(EngineConfig.from_kwargs(model=str(path), dtype="float32", tensor_parallel_size=tp, **kw))
    try:
        for i, p in enumerate(ps):
            e.add_request(f"r{i}", p, params)
        out = {k: o.outputs[0].token_ids for k, o in drain(e).items()}
        e.check_integrity()
        g = e.executor.group if isinstance(e.executor, TPExecutor) else None
        reduces = (g.num_all_reduces, g.num_shm_all_reduces) if g else (0, 0)
        return out, reduces, e.stats()
    finally:
        e.close()


def test_tp2_equals_tp1_on_the_tiny_model(tiny_llama):
    ps = prompts(5, seed=7, lo=20, hi=40)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(block_size=4, num_gpu_blocks_override=24, max_num_batched_tokens=32)  # chunked prefill, preemption
    want, _, _ = run(tiny_llama, ps, 1, params, **kw)
    got, (reduces, shm), stats = run(tiny_llama, ps, 2, params, **kw)
    assert got == want
    assert reduces > 0 and shm == reduces and stats.num_preemptions > 0  # every all-reduce took shared memory
    gloo, (reduces, shm), _ = run(tiny_llama, ps, 2, params, tensor_parallel_gloo_only=True, **kw)
    assert gloo == want and reduces > 0 and shm == 0


@pytest.mark.slow
def test_tp3_equals_tp1_on_the_default_model(real_model_path):
    from tokenmill.models.loader import load_model

    tok = load_model(str(real_model_path), load_tokenizer=True).tokenizer
    ps = [
        tok.encode(t)
        for t in ("The capital of France is", "Paged attention stores keys and values in", "def fibonacci(n):")
    ]
    # shards split dense weights, so TP 3 dequantizes the file at load: TP 1 does too, to compare like with like
    want, _, _ = run(real_model_path, ps, 1, max_model_len=256, gguf_dequantize=True)
    got, (reduces, shm), _ = run(real_model_path, ps, 3, max_model_len=256)
    assert got == want and reduces == shm > 0


def test_tp2_with_ngram_speculation_equals_tp1_without(tiny_llama):
    """Rank 0's runner drafts and verifies; rank 1 follows the broadcast steps, drafts included."""
    ps = [[9] * 6, [1, 5, 6, 7, 8, 5, 6, 7] * 3] + prompts(2, seed=5, lo=20, hi=30)  # the first two repeat
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(block_size=4, num_gpu_blocks_override=40, max_num_batched_tokens=32)
    want, _, _ = run(tiny_llama, ps, 1, params, **kw)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False, "prompt_lookup_min": 1}
    got, (reduces, _), stats = run(tiny_llama, ps, 2, params, speculative_config=spec, **kw)
    assert got == want and reduces > 0
    assert stats.spec_decode["num_draft_tokens"] > 0 and stats.spec_decode["num_accepted_tokens"] > 0


def test_tp2_with_an_ngram_tree_equals_tp1_without(tiny_llama, tmp_path):
    """Rank 0 verifies the trees and moves each accepted path's K/V; ranks 1.. replay the moves before the next
    step (TPExecutor's RankStep), or their caches would hold the wrong nodes' K/V and the tokens would drift. A
    datastore that lists a wrong continuation beside each right one makes accepted paths leave the first branch
    (as tests/spec_decode/test_engine.py does for one process)."""
    from tests.spec_decode.test_engine import branching_tree_config

    ps = [[9] * 6, [1, 5, 6, 7, 8, 5, 6, 7] * 3] + prompts(2, seed=5, lo=20, hi=30)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(block_size=4, num_gpu_blocks_override=40, max_num_batched_tokens=32)
    want, _, _ = run(tiny_llama, ps, 1, params, **kw)
    spec = branching_tree_config(tmp_path / "store.npz", [p + want[f"r{i}"] for i, p in enumerate(ps)])
    e = EngineCore(
        EngineConfig.from_kwargs(
            model=str(tiny_llama), dtype="float32", tensor_parallel_size=2, speculative_config=spec, **kw
        )
    )
    try:
        for i, p in enumerate(ps):
            e.add_request(f"r{i}", p, params)
        got = {k: o.outputs[0].token_ids for k, o in drain(e).items()}
        assert isinstance(e.executor, TPExecutor)
        moved = e.executor.runner.num_paths_compacted
        sd = e.stats().spec_decode
    finally:
        e.close()
    assert got == want
    assert sd["num_accepted_tokens"] > 0 and moved > 0  # trees verified, paths off the first branch moved


@pytest.mark.parametrize("method", ["draft_model", "eagle", "medusa", "ngram_adaptive"])
def test_tp2_with_a_draft_model_or_head_equals_tp1_without(tiny_llama, method, request):
    """A draft model or head runs whole on rank 0 alone, between the broadcast steps: a self-draft loads its own
    copy (the target on rank 0 is a shard), EAGLE and Medusa read the target's tables before the head is split,
    and the adaptive controller, which cannot time a shard alone, learns from the steps (this hung before)."""
    ps = [[9] * 6, [1, 5, 6, 7, 8, 5, 6, 7] * 3] + prompts(2, seed=5, lo=20, hi=30)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(block_size=4, num_gpu_blocks_override=40, max_num_batched_tokens=32)
    want, _, _ = run(tiny_llama, ps, 1, params, **kw)
    spec: dict = {"num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        spec.update(method="draft_model", model=str(tiny_llama))  # the target itself: its drafts are accepted
    elif method == "eagle":  # heads trained on the tiny model by the spec_decode tests' fixtures
        spec.update(method="eagle", model=str(request.getfixturevalue("trained_head")[0]))
    elif method == "medusa":
        spec.update(method="medusa", model=str(request.getfixturevalue("trained_medusa")[0]))
    else:
        spec.update(method="ngram", adaptive=True, prompt_lookup_min=1)
    got, (reduces, _), stats = run(tiny_llama, ps, 2, params, speculative_config=spec, **kw)
    assert got == want and reduces > 0
    sd = stats.spec_decode
    assert sd["num_draft_tokens"] > 0
    if method == "ngram_adaptive":  # the controller's choices follow step timings: only the tokens must agree
        return
    _, _, one = run(tiny_llama, ps, 1, params, speculative_config=spec, **kw)
    counted = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    assert {k: sd[k] for k in counted} == {k: one.spec_decode[k] for k in counted}  # the same drafts as TP = 1
    if method != "medusa":  # heads trained on a random tiny model's corpus do not generalise to these prompts
        assert sd["num_accepted_tokens"] > 0


def test_a_rank_that_dies_while_starting_is_reported_at_once(tiny_llama, tmp_path):
    """A rank that exits before the group forms (here: its model file is gone) fails the start within seconds,
    with its exit code, its stderr and the main-guard hint, not after the store's 300 s timeout."""
    import shutil
    import time

    from tokenmill.config import ModelConfig
    from tokenmill.worker.executor import RunnerOptions, load_target, plan_kv_cache
    from tokenmill.worker.process import WorkerDiedError
    from tokenmill.worker.tp_executor import TPExecutor

    copy = tmp_path / "model"
    shutil.copytree(tiny_llama, copy)
    cfg = EngineConfig.from_kwargs(
        model=str(copy), dtype="float32", tensor_parallel_size=2, block_size=4, num_gpu_blocks_override=8
    )
    loaded = load_target(cfg.model, load_tokenizer=False)
    opts = RunnerOptions.from_config(cfg, plan_kv_cache(loaded.config, cfg, 64, 1 << 30), 64)
    shutil.rmtree(copy)  # rank 1 loads it after spawn: it fails and exits
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"(?s)rank 1 .*exited with code 1 while starting.*model.*__main__"):
        TPExecutor(loaded.model, opts, timeout_s=300)
    assert time.monotonic() - t0 < 60
    assert isinstance(ModelConfig(), ModelConfig)


def test_a_rank_killed_between_steps_fails_the_next_step(tiny_llama):
    import os
    import signal
    import time

    from tokenmill.worker.process import WorkerDiedError

    e = EngineCore(EngineConfig.from_kwargs(model=str(tiny_llama), dtype="float32", tensor_parallel_size=2))
    try:
        e.add_request("a", [1, 2, 3, 4], GREEDY)
        e.step()
        rank1 = e.executor.workers[0].proc
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(5)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1 .*code -9 during a step"):
            for _ in range(3):
                e.step()
        assert time.monotonic() - t0 < 5
    finally:
        e.close()


def test_a_size_that_does_not_divide_is_refused(tiny_llama):
    from tokenmill.models.loader import load_model

    arch = load_model(str(tiny_llama), load_tokenizer=False).config  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="does not divide the model's query heads \\(4\\), KV heads \\(2\\).*1, 2"):
        check_tensor_parallel(arch, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        EngineCore(EngineConfig.from_kwargs(model=str(tiny_llama), dtype="float32", tensor_parallel_size=3))
