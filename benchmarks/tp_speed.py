"""Decode speed, TP = 1 vs TP = N (shared-memory and gloo all-reduce), on this machine (one torch thread per
rank; ranks share its cores).

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
    for name, tp, gloo in (("tp1", 1, False), ("shm", args.tp, False), ("gloo", args.tp, True)):
        e = EngineCore(
            EngineConfig.from_kwargs(
                model=args.model,
                dtype=args.dtype,
                tensor_parallel_size=tp,
                tensor_parallel_gloo_only=gloo,
                max_model_len=512,
            )
        )
        try:
            decode_rate(e, 1, 8)  # warm-up
            rows[name] = [decode_rate(e, b, args.tokens) for b in batches]
        finally:
            e.close()
    n = args.tp
    print(f"# decode tok/s, {args.model} {args.dtype}, {os.cpu_count()} cores, 1 torch thread per rank")
    print(f"| batch | TP = 1 | TP = {n}, shared-memory all-reduce | TP = {n}, gloo all-reduce | ratios to TP = 1 |")
    print("|---|---|---|---|---|")
    for j, b in enumerate(batches):
        one, shm, gloo = rows["tp1"][j], rows["shm"][j], rows["gloo"][j]
        print(f"| {b} | {one:.1f} | {shm:.1f} | {gloo:.1f} | {shm / one:.2f}x / {gloo / one:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
