"""What a step-time target (SchedulerConfig.target_step_ms) does to running streams when long prompts arrive.

    python benchmarks/step_target.py [--targets none,60] [--streams 16] [--long-len 2000] [--budget 512]

Offline engine (no HTTP), bf16, the default model. Per setting: `--streams` requests decode (ignore_eos); once they
are all decoding, `--long` prompts of `--long-len` tokens arrive one after another (each when the previous one
has its first token). Reported: the streams' inter-token latency (every step that gave them a token: the step's
wall time), p50 / p99 / max, and the long prompts' TTFT in steps and seconds. All settings in one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill import SamplingParams  # noqa: E402
from tokenmill.bench.common import percentile, set_threads  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine.core import EngineCore  # noqa: E402


def run(args, target: float | None) -> dict:
    e = EngineCore(
        EngineConfig.from_kwargs(
            model=args.model,
            dtype="bfloat16",
            max_num_batched_tokens=args.budget,
            target_step_ms=target,
            max_model_len=args.long_len + 64,
        )
    )
    stream = SamplingParams(temperature=0, max_tokens=100_000 // 100, ignore_eos=True)
    for i in range(args.streams):
        e.add_request(f"s{i}", [1, 504, 3458, 282, 4649, 314, 10 + i], stream)
    for _ in range(20):  # all streams decoding; the step model has seen prompt chunks and decodes
        e.step()
    itl, ttfts = [], []
    for j in range(args.long):
        prompt = [(1000 + 7 * j + 13 * k) % 40000 + 100 for k in range(args.long_len)]
        e.add_request(f"long{j}", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        t_arrive, steps = time.perf_counter(), 0
        while True:
            t0 = time.perf_counter()
            outs = e.step()
            dt = time.perf_counter() - t0
            steps += 1
            if any(o.request_id.startswith("s") for o in outs):
                itl.append(dt)
            if any(o.request_id == f"long{j}" for o in outs):
                ttfts.append((steps, time.perf_counter() - t_arrive))
                break
    for _ in range(10):  # a few plain decode steps after the last arrival
        t0 = time.perf_counter()
        e.step()
        itl.append(time.perf_counter() - t0)
    cost = e.scheduler.step_cost.cost
    return {"itl": itl, "ttft": ttfts, "cost": cost}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--targets", default="none,60", help="comma list of target_step_ms values (none: unset)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--long", type=int, default=3)
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    set_threads(args.threads)
    print(
        f"# {args.streams} decode streams, {args.long} prompts of {args.long_len} tokens arriving one after another; "
        f"step budget {args.budget}; bf16; {args.threads} threads"
    )
    print("| target_step_ms | stream ITL p50 | p99 | max | long-prompt TTFT (steps, s) | fitted step model |")
    print("|---|---|---|---|---|---|")
    for t in args.targets.split(","):
        target = None if t == "none" else float(t)
        r = run(args, target)
        ms = [1000 * x for x in r["itl"]]
        c = r["cost"]
        model = f"{1000 * c.a:.1f} + {1000 * c.b:.2f} d + {1000 * c.c:.3f} p + {1000 * c.e:.3f} k ms" if c else "-"
        tt = ", ".join(f"{s} / {sec:.2f}" for s, sec in r["ttft"])
        print(
            f"| {t} | {percentile(ms, 50):.0f} ms | {percentile(ms, 99):.0f} ms | {max(ms):.0f} ms | {tt} | {model} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
