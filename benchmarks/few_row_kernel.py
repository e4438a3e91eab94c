"""A/B of the VNNI few-row bf16 kernel (docs/cpu_decode.md, item 21) against the kernels it replaced.

Two engines in one process, one built with the VNNI-packed weight copies and one without (then steps
of 2-8 tokens take the row-major GEMV or oneDNN, as before the kernel), decoding the same prompts
greedily in interleaved rounds at each batch size. Prints tok/s per engine (median of rounds), the
ratio, and whether both produced the same tokens (they need not: the kernels round differently).

    python benchmarks/few_row_kernel.py --threads 2 --batches 1,4,8 --tokens 128 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import fused_ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    real = fused_ops.pack_vnni
    engines = {}
    for name in ("without", "vnni"):
        fused_ops.pack_vnni = (lambda w: None) if name == "without" else real  # read when weights are prepacked
        engines[name] = LLM(args.model, dtype="bfloat16", enable_prefix_caching=False)
    fused_ops.pack_vnni = real
    prompts = [f"Write a short story about a robot number {i} who learns to paint." for i in range(max(batches))]
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    rates: dict[tuple[int, str], list[float]] = {}
    tokens: dict[tuple[int, str], list[list[int]]] = {}
    for _ in range(args.rounds):
        for bs in batches:
            for name, llm in engines.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:bs], sp)
                rates.setdefault((bs, name), []).append(bs * args.tokens / (time.perf_counter() - t0))
                tokens[(bs, name)] = [o.outputs[0].token_ids for o in outs]
    print(f"# {args.model}, bf16, {args.threads} threads, {args.tokens} tokens/request, median of {args.rounds} rounds")
    print("| batch | without (tok/s) | VNNI (tok/s) | ratio | same tokens |")
    print("|---|---|---|---|---|")
    for bs in batches:
        a, b = statistics.median(rates[(bs, "without")]), statistics.median(rates[(bs, "vnni")])
        print(f"| {bs} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {tokens[(bs, 'without')] == tokens[(bs, 'vnni')]} |")


if __name__ == "__main__":
    main()
