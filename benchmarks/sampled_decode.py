"""What sampling costs: plain decoding greedy vs sampled, one stream and 32 (the default model, no speculation).

    .venv/bin/python benchmarks/sampled_decode.py --old-tree /tmp/old --rounds 3

Batch 1: 4 ShareGPT chats x 128 tokens one at a time, greedy and at temperature 0.7 (seeded), the best of two
passes each. Batch 32: 32 chats x 64 tokens at once, greedy and at temperature 1 (OpenAI's default), prefix
caching off so both passes prefill alike. The ratio sampled / greedy is what a sampled token costs beyond a
greedy one. With --old-tree each checkout runs in a fresh process, rounds interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(threads: int) -> dict[str, float]:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from spec_decode import sharegpt_prompts  # benchmarks/spec_decode.py

    from tokenmill import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM("smollm2-135m", max_num_seqs=32, enable_prefix_caching=False)
    prompts = sharegpt_prompts(llm.tokenizer, 33, 256)
    out: dict[str, float] = {}
    for temp in (0.0, 0.7):
        params = [SamplingParams(temperature=temp, max_tokens=128, ignore_eos=True, seed=i) for i in range(5)]
        llm.generate([prompts[0]], params[0])  # warm
        best = 0.0
        for _ in range(2):
            t = time.perf_counter()
            for p, s in zip(prompts[1:5], params[1:5]):
                llm.generate([p], s)
            best = max(best, 4 * 128 / (time.perf_counter() - t))
        out[f"batch 1, T={temp:g}"] = best
    for temp in (0.0, 1.0):
        params = [SamplingParams(temperature=temp, max_tokens=64, ignore_eos=True) for _ in range(32)]
        t = time.perf_counter()
        llm.generate(prompts[1:33], params)
        out[f"batch 32, T={temp:g}"] = 32 * 64 / (time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-tree", type=Path, default=None, help="another checkout, run in its own processes")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.threads)))
        return
    trees = {"this tree": REPO} if args.old_tree is None else {"old": args.old_tree.resolve(), "this tree": REPO}
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            # PYTHONPATH puts the old checkout's package ahead of this tree's editable install
            env = {**os.environ, "PYTHONPATH": str(tree)} if tree != REPO else dict(os.environ)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--threads", str(args.threads), "--child"]
            done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=1800)
            if done.returncode:
                raise SystemExit(f"{name}: {done.stderr[-3000:]}")
            rows[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("| tree | round | batch 1 greedy | batch 1 T=0.7 | ratio | batch 32 greedy | batch 32 T=1 | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in rows.items():
        for i, r in enumerate(runs):
            b1, s1, b32, s32 = r["batch 1, T=0"], r["batch 1, T=0.7"], r["batch 32, T=0"], r["batch 32, T=1"]
            print(
                f"| {name} | {i + 1} | {b1:.1f} | {s1:.1f} | {s1 / b1:.2f} | {b32:.1f} | {s32:.1f} | {s32 / b32:.2f} |"
            )


if __name__ == "__main__":
    main()
