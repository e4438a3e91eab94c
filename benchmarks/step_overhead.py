"""Per-step time outside the model (scheduling, input preparation, sampling, detokenizing, outputs) of
decode steps at batch 1 and batch 64, this tree against another checkout, each in a fresh process, rounds
interleaved, median kept. "The model" is the forward pass (the C++ layer loop or the modules) and the LM
head; everything else `EngineCore.step` does counts as outside.

    git worktree add /tmp/old <commit> && (cd /tmp/old && python setup.py build_ext --inplace)
    .venv/bin/python benchmarks/step_overhead.py --old-tree /tmp/old --rounds 3

--long: one 2,000-token reply with logprobs (top 5) in this tree, outside-the-model time per step in
windows of 250 positions, for cumulative outputs (what every step built before deltas) and deltas (what
the server now streams): a cost that grows with position shows as a rising row.

    .venv/bin/python benchmarks/step_overhead.py --long
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TIMERS = r"""
spent = [0.0]  # seconds in the model this step: the forward (either driver) and the LM head


def timed(fn):
    def call(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t0
    return call


class TimedLoop:  # the C++ layer loop, whichever tree's
    def __init__(self, loop): self.loop = loop
    def __getattr__(self, name): return getattr(self.loop, name)
    def __call__(self, *a): return timed(self.loop)(*a)


if runner.decode_loop is not None:
    runner.decode_loop = TimedLoop(runner.decode_loop)
runner.model.forward = timed(runner.model.forward)
runner.model.compute_logits = timed(runner.model.compute_logits)
"""

CHILD = (
    r"""
import json, sys, time
from tokenmill import LLM, SamplingParams
batch, steps = int(sys.argv[1]), int(sys.argv[2])
llm = LLM("smollm2-135m", dtype="bfloat16", max_model_len=512, max_num_seqs=64, enable_prefix_caching=False)
engine = llm.engine
# NOTE: checkouts before the executor seam (0b07fa0 and older) hold the runner on the engine itself.
runner = engine.executor.runner if hasattr(engine, "executor") else engine.runner
"""
    + TIMERS
    + r"""prompts = [f"Write a short story about a robot number {i} who learns to paint." for i in range(batch)]
params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
for i, p in enumerate(prompts):
    engine.add_request(str(i), engine.tokenizer.encode(p), params)
while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
    engine.step()  # prompts, not timed
for _ in range(4):
    engine.step()
total = model = 0.0
for _ in range(steps):
    spent[0] = 0.0
    t0 = time.perf_counter()
    engine.step()
    total += time.perf_counter() - t0
    model += spent[0]
print(json.dumps({"step_ms": 1e3 * total / steps, "model_ms": 1e3 * model / steps,
                  "outside_ms": 1e3 * (total - model) / steps}))
"""
)


LONG_CHILD = (
    r"""
import json, sys, time
from tokenmill import LLM, SamplingParams
kind, steps = sys.argv[1], int(sys.argv[2])
llm = LLM("smollm2-135m", dtype="bfloat16", max_model_len=4096, enable_prefix_caching=False)
engine = llm.engine
runner = engine.executor.runner if hasattr(engine, "executor") else engine.runner  # older checkouts: engine.runner
"""
    + TIMERS
    + r"""params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True, logprobs=5, output_kind=kind)
engine.add_request("r", engine.tokenizer.encode("Tell me a very long story."), params)
engine.step()
windows, outside = [], 0.0
for i in range(1, steps + 1):
    spent[0] = 0.0
    t0 = time.perf_counter()
    engine.step()
    outside += time.perf_counter() - t0 - spent[0]
    if i % 250 == 0:
        windows.append(round(1e3 * outside / 250, 3))
        outside = 0.0
print(json.dumps({"kind": kind, "outside_ms_per_step_by_250": windows}))
"""
)


def long_reply(steps: int) -> None:
    for kind in ("cumulative", "delta"):
        out = subprocess.run(
            [sys.executable, "-c", LONG_CHILD, kind, str(steps)],
            capture_output=True,
            text=True,
            timeout=1800,
            cwd=REPO,
            check=True,
        )
        print(out.stdout.strip().splitlines()[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-tree", type=Path)
    ap.add_argument("--long", action="store_true", help="the 2,000-token reply instead (this tree only)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    if args.long:
        long_reply(2000)
        return
    if args.old_tree is None:
        ap.error("--old-tree is needed (or --long)")
    trees = {"old": {"PYTHONPATH": str(args.old_tree.resolve())}, "this tree": {}}
    res: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.rounds):
        for batch in (1, 64):
            for name, env in trees.items():
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, str(batch), str(args.steps)],
                    env={**os.environ, **env},
                    capture_output=True,
                    text=True,
                    timeout=1800,
                    cwd=args.old_tree if name == "old" else REPO,
                    check=True,
                )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                res.setdefault((name, batch), []).append(row)
                print(name, batch, row, flush=True)
    for (name, batch), rows in res.items():
        print(name, f"batch {batch}", {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]})


if __name__ == "__main__":
    main()
