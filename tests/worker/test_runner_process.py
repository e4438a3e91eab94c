"""The runner needs nothing but the step data (core/step_io.py): one in another process (MultiprocExecutor, the
`mp` executor backend) gives the same tokens as one in this process, through chunked prompts, a prefix hit,
preemption, n > 1 forks and a seeded sampled request, with and without speculation (which lives in the runner:
its drafts come back in the step output and are counted here, not assumed). A runner process that dies, while
starting or during a step, is reported within seconds with its exit code."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

# test_eagle's fixtures, for the EAGLE case: importing them here is how pytest shares a test module's fixtures
from tests.spec_decode.test_eagle import corpus, trained_head  # noqa: E402, F401
from tokenmill.config import CacheConfig, KVCacheSpec, ModelConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.step_io import StepInput, StepOutput
from tokenmill.models.loader import load_model
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.executor import RunnerOptions, UniProcExecutor
from tokenmill.worker.process import MultiprocExecutor, WorkerDiedError

NUM_BLOCKS, BLOCK_SIZE = 14, 4


def requests() -> list[tuple[Request, list[Request]]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True, frequency_penalty=0.3)
    shared = list(range(30, 42))
    out = [
        (Request("a", shared + [5], greedy, None, 10), []),
        (Request("b", shared + [6, 7], greedy, None, 10), []),  # a prefix hit on a's blocks
        (Request("c", [3, 1, 4, 1, 5, 9, 2, 6], seeded, None, 10), []),
        (Request("e", [9] * 6, greedy, None, 10), []),
    ]  # the tiny model repeats itself here: n-gram drafts
    forks = [
        Request(f"d#{i}", [8, 9, 10], seeded.clone(seed=20 + i), None, 6, sample_index=i, parent_id="d")
        for i in range(3)
    ]
    out.append((forks[0], forks[1:]))
    return out


def run(execute) -> tuple[dict[str, list[int]], int, dict[str, float]]:
    """Tokens of requests() with a small pool (preemption) and an 8-token budget (chunks); the last step's
    speculation counters."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        NUM_BLOCKS,
        64,
    )
    reqs = requests()
    for leader, forks in reqs:
        sched.add_request(leader, forks=forks)
    everyone = [r for leader, forks in reqs for r in [leader, *forks]]
    steps = 0
    spec: dict[str, float] = {}
    while sched.has_unfinished():
        out = sched.schedule()
        result: StepOutput = execute(out.step)
        spec = result.spec_metrics or spec
        sched.update(out, result)
        steps += 1
        assert steps < 500
    execute(sched.schedule().step)  # an empty step hands over the last finished ids: rows dropped
    sched.check_integrity()
    return {r.request_id: list(r.output_token_ids) for r in everyone}, sched.num_preemptions, spec


def options(path, speculative: SpeculativeConfig | None = None) -> RunnerOptions:
    arch = load_model(str(path), dtype=torch.float32, load_tokenizer=False).config
    kv = KVCacheSpec(
        NUM_BLOCKS, BLOCK_SIZE, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, torch.float32
    )
    return RunnerOptions(
        ModelConfig(str(path), dtype="float32"), kv, max_num_seqs=8, max_model_len=64, speculative=speculative
    )


def speculative_configs(path) -> dict[str, SpeculativeConfig | None]:
    return {
        "plain": None,
        "ngram_chain": SpeculativeConfig.from_dict(
            {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False, "prompt_lookup_min": 1}
        ),
        "ngram_tree": SpeculativeConfig.from_dict(
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "adaptive": False,
                "prompt_lookup_min": 1,
                "tree": {"max_nodes": 6, "max_width": 3},
            }
        ),
        "draft_model": SpeculativeConfig.from_dict(
            {
                "method": "draft_model",
                "model": str(path),
                "draft_num_layers": 1,
                "num_speculative_tokens": 3,
                "adaptive": False,
            }
        ),
    }


@pytest.mark.parametrize("name", ["plain", "ngram_chain", "ngram_tree", "draft_model", "eagle"])
def test_runner_in_another_process_gives_the_same_tokens(tiny_llama, name, request):
    if name == "eagle":  # a head trained on the tiny model (tests/spec_decode/test_eagle.py's fixture)
        head_dir = request.getfixturevalue("trained_head")[0]
        config = SpeculativeConfig.from_dict(
            {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 3, "adaptive": False}
        )
    else:
        config = speculative_configs(tiny_llama)[name]
    opts = options(tiny_llama, config)
    loaded = load_model(str(tiny_llama), dtype=torch.float32, load_tokenizer=False)
    local = UniProcExecutor(loaded.model, loaded.config, opts)
    here, preemptions, spec_here = run(local.execute)
    if name == "plain":
        assert preemptions > 0  # the pool is small enough to preempt: rows are dropped and sent again
    assert all(len(t) == 10 for rid, t in here.items() if not rid.startswith("d"))
    with MultiprocExecutor(opts) as remote:
        there, _, spec_there = run(remote.execute)
        assert remote.steps > 10 and remote.pid is not None
    assert there == here
    counted = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    assert {k: spec_there.get(k) for k in counted} == {k: spec_here.get(k) for k in counted}
    if name != "plain":  # drafts were made, verified and some accepted, in both processes
        assert spec_here["num_draft_tokens"] > 0 and spec_here["num_accepted_tokens"] > 0
    assert not local.runner.requests  # every row dropped once its request finished


def test_speculative_greedy_equals_plain_in_the_runner_process(tiny_llama):
    """The greedy rows of requests() with the runner's own n-gram drafts are the plain runner's tokens."""
    plain, _, _ = run(UniProcExecutor(*_loaded(tiny_llama), options(tiny_llama)).execute)
    with MultiprocExecutor(options(tiny_llama, speculative_configs(tiny_llama)["ngram_chain"])) as remote:
        spec, _, counters = run(remote.execute)
    assert counters["num_draft_tokens"] > 0
    assert {k: spec[k] for k in "abe"} == {k: plain[k] for k in "abe"}


def _loaded(path):
    loaded = load_model(str(path), dtype=torch.float32, load_tokenizer=False)
    return loaded.model, loaded.config


def test_a_runner_process_that_dies_while_starting_is_reported(tmp_path):
    bad = ModelConfig(str(tmp_path / "missing.gguf"), dtype="float32")
    opts = RunnerOptions(bad, KVCacheSpec(4, 4, 1, 1, 8, torch.float32), 1, 16)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="missing.gguf"):
        MultiprocExecutor(opts)
    assert time.monotonic() - t0 < 60


def test_a_runner_process_killed_during_serving_is_reported_with_its_exit_code(tiny_llama):
    ex = MultiprocExecutor(options(tiny_llama))
    try:
        os.kill(ex.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=f"pid {ex.pid}.*code -9 during a step"):
            ex.execute(StepInput())
        assert time.monotonic() - t0 < 5
    finally:
        ex.shutdown()


def test_the_mp_backend_serves_the_engine_and_loads_the_weights_only_in_the_runner_process(tiny_llama):
    """`distributed_executor_backend="mp"` through the public API: the same greedy tokens (and n-gram drafts) as the
    in-process runner, while the engine's own process reads only the checkpoint's config and tokenizer."""
    from tokenmill import LLM, SamplingParams

    prompts = [[9] * 6, [1, 5, 6, 7, 8, 5, 6, 7] * 3, [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False, "prompt_lookup_min": 1}
    here = LLM(str(tiny_llama), dtype="float32", speculative_config=spec)
    want = [o.outputs[0].token_ids for o in here.generate(prompts, params, use_tqdm=False)]
    there = LLM(str(tiny_llama), dtype="float32", speculative_config=spec, distributed_executor_backend="mp")
    try:
        got = [o.outputs[0].token_ids for o in there.generate(prompts, params, use_tqdm=False)]
        executor = there.engine.executor
        assert isinstance(executor, MultiprocExecutor) and executor.steps > 1
        assert there.engine.model is None  # no weights in this process
        assert got == want
        counted = ("num_draft_tokens", "num_accepted_tokens")
        sd_there, sd_here = there.stats().spec_decode, here.stats().spec_decode
        assert {k: sd_there[k] for k in counted} == {k: sd_here[k] for k in counted} and sd_there[counted[1]] > 0
    finally:
        there.engine.close()
