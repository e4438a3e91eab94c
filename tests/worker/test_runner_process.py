"""The runner needs nothing but the step data (core/step_io.py): one in another process gives the same
tokens as one in this process, through chunked prompts, a prefix hit, preemption, n > 1 forks and a
seeded sampled request."""
from __future__ import annotations

import torch

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.scheduler import Scheduler
from tokenmill.models.loader import load_model
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.model_runner import KVCacheSpec, ModelRunner
from tokenmill.worker.process import RunnerProcess, RunnerSpec

NUM_BLOCKS, BLOCK_SIZE = 14, 4


def requests() -> list[tuple[Request, list[Request]]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True,
                            frequency_penalty=0.3)
    shared = list(range(30, 42))
    out = [(Request("a", shared + [5], greedy, None, 10), []),
           (Request("b", shared + [6, 7], greedy, None, 10), []),   # a prefix hit on a's blocks
           (Request("c", [3, 1, 4, 1, 5, 9, 2, 6], seeded, None, 10), [])]
    forks = [Request(f"d#{i}", [8, 9, 10], seeded.clone(seed=20 + i), None, 6, sample_index=i, parent_id="d")
             for i in range(3)]
    out.append((forks[0], forks[1:]))
    return out


def run(execute) -> tuple[dict[str, list[int]], int]:
    """Greedy/seeded tokens of requests() with a small pool (preemption) and an 8-token budget (chunks)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8),
                      CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True), NUM_BLOCKS, 64)
    reqs = requests()
    for leader, forks in reqs:
        sched.add_request(leader, forks=forks)
    everyone = [r for leader, forks in reqs for r in [leader, *forks]]
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, execute(out.step))
        steps += 1
        assert steps < 500
    execute(sched.schedule().step)  # an empty step hands over the last finished ids: rows dropped
    sched.check_integrity()
    return {r.request_id: list(r.output_token_ids) for r in everyone}, sched.num_preemptions


def test_runner_in_another_process_gives_the_same_tokens(tiny_llama):
    loaded = load_model(str(tiny_llama), dtype=torch.float32, load_tokenizer=False)
    arch = loaded.config
    kv = KVCacheSpec(NUM_BLOCKS, BLOCK_SIZE, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
                     torch.float32)
    local = ModelRunner(loaded.model, arch, kv, torch.device("cpu"), seed=0)
    here, preemptions = run(local.execute)
    assert preemptions > 0  # the pool is small enough to preempt: rows are dropped and sent again
    assert all(len(t) == 10 for rid, t in here.items() if not rid.startswith("d"))
    with RunnerProcess(RunnerSpec(str(tiny_llama), "float32", NUM_BLOCKS, BLOCK_SIZE, seed=0)) as remote:
        there, _ = run(remote.execute)
        assert remote.steps > 10 and remote.pid is not None
    assert there == here
    assert not local.requests  # every row dropped once its request finished
