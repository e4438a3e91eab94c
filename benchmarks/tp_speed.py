"""Decode speed, TP = 1 vs TP = N, on this machine (one torch thread per rank; ranks share its cores).

    python benchmarks/tp_speed.py [--tp 3] [--batches 1,8] [--tokens 64]

Each setup: one engine, a warm-up request, then `batch` requests of `--tokens` greedy tokens (ignore_eos) at once;
decode tok/s = generated tokens / wall time of the steps after every prompt is computed. Both in one run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENMILL_NUM_THREADS", "1")

from tokenmill import SamplingParams  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine.core import EngineCore  # noqa: E402


def decode_rate(e: EngineCore, batch: int, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        e.add_request(f"b{batch}-{i}-{time.time()}", [1, 504, 3458, 282, 4649, 314, 10 + i], params)
    e.step()  # the prompts (and first tokens)
    t0, n0 = time.perf_counter(), e.num_generation_tokens
    while e.has_unfinished_requests():
        e.step()
    return (e.num_generation_tokens - n0) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = {}
    for tp in (1, args.tp):
        e = EngineCore(EngineConfig.from_kwargs(model=args.model, dtype=args.dtype, tensor_parallel_size=tp,
                                                max_model_len=512))
        try:
            decode_rate(e, 1, 8)  # warm-up
            rows[tp] = [decode_rate(e, b, args.tokens) for b in batches]
        finally:
            e.close()
    print(f"# decode tok/s, {args.model} {args.dtype}, {os.cpu_count()} cores, 1 torch thread per rank")
    print("| batch | TP = 1 | TP = %d | ratio |" % args.tp)
    print("|---|---|---|---|")
    for j, b in enumerate(batches):
        print(f"| {b} | {rows[1][j]:.1f} | {rows[args.tp][j]:.1f} | {rows[args.tp][j] / rows[1][j]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
