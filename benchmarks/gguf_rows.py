"""What a step of M rows costs the GGUF integer kernel: every GGUF linear of the model (the layers' and the tied
head), one after the other as a forward reads them (their bytes do not fit in cache, so each pass reads them
from memory), at M activation rows. Speculative verification runs 1 + γ rows per request; batched decoding runs
one per request.

    .venv/bin/python benchmarks/gguf_rows.py [--model smollm2-135m] [--rows 1,2,4,5,8,9,13,16,32] [--rounds 6]

Prints per M the best pass time over the rounds (rounds interleave the row counts, so a slow spell of a shared
host hits them alike), its ratio to M = 1 and the weights' bytes over that time.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill import LLM
from tokenmill.layers.linear import Linear
from tokenmill.quant import gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,2,4,5,8,9,13,16,32")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_bytes=64 << 20)
    parts = [
        m.quant_method.parts
        for m in llm.engine.executor.runner.model.modules()
        if isinstance(m, Linear) and isinstance(m.quant_method, gguf.GGUFLinearMethod)
    ]
    if not parts:
        raise SystemExit(f"{args.model} has no GGUF linears kept quantized")
    nbytes = sum(p.packed.numel() for ps in parts for p in ps)
    rows = [int(m) for m in args.rows.split(",")]
    inputs = {m: {ps[0].cols: torch.randn(m, ps[0].cols, dtype=dtype) for ps in parts} for m in rows}
    best = {m: float("inf") for m in rows}
    for _ in range(args.rounds):
        for m in rows:
            for _ in range(3):
                t0 = time.perf_counter()
                for ps in parts:
                    if gguf.linear(inputs[m][ps[0].cols], ps) is None:
                        raise SystemExit("the GGUF integer kernel does not serve this CPU")
                best[m] = min(best[m], time.perf_counter() - t0)
    print(
        f"# {args.model}: {len(parts)} GGUF linears, {nbytes / 1e6:.1f} MB, kernel {gguf.kernel_name()}, "
        f"{args.threads} threads, best of {args.rounds} rounds x 3\n"
    )
    print("| rows M | pass ms | / M = 1 | GB/s |")
    print("|---|---|---|---|")
    for m in rows:
        print(f"| {m} | {best[m] * 1e3:.2f} | {best[m] / best[rows[0]]:.2f} | {nbytes / best[m] / 1e9:.1f} |")


if __name__ == "__main__":
    main()
