"""Where a pure N-stream decode step spends its time: the offline engine with N ShareGPT prompts admitted and
prefilled, then cProfile over S decode steps (no prompt arrives meanwhile), printing ms per step, tok/s and the
functions with the most own time (the C++ layer loop is `forward_rows`, the LM head `dense_linear`).

    .venv/bin/python benchmarks/decode_step_profile.py [--streams 32] [--steps 60] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from tokenmill import LLM, SamplingParams
from tokenmill.bench.common import first_turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    rows = first_turns(args.streams + 1, 5, 2000)
    llm = LLM(dtype=args.dtype, max_model_len=1024, max_num_seqs=args.streams)
    llm.generate(rows[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.steps + 100, ignore_eos=True)
    for i, text in enumerate(rows[1:]):
        eng.add_request(f"s{i}", llm.tokenizer.encode(text), params)
    while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
        eng.step()  # every prompt admitted and prefilled: from here on, decode steps only
    for _ in range(10):
        eng.step()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        eng.step()
    prof.disable()
    dt = time.perf_counter() - t0
    print(
        f"{args.steps} steps of {args.streams} decodes: {dt / args.steps * 1000:.1f} ms per step, "
        f"{args.streams * args.steps / dt:.0f} tok/s"
    )
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
