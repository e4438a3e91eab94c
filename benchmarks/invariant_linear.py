"""What a batch-invariant bf16 linear costs: the AMX kernel (one reduction order for every row count,
csrc/gemm_amx.cpp) against the few-row VNNI kernel and oneDNN's prepacked linear, on the default model's
linear shapes and its tied LM head, for 1..512 rows. Best of --repeats, one run, microseconds.

    .venv/bin/python benchmarks/invariant_linear.py --threads 2
"""
from __future__ import annotations

import argparse

import torch

from tokenmill.bench.common import best_seconds
from tokenmill.layers import fused_ops

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 2, 4, 8, 16, 64, 128, 512)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = torch.ops.tokenmill
    print(f"{'shape':8} {'rows':>5} {'amx us':>9} {'vnni us':>9} {'onednn us':>10} {'amx/onednn':>11} {'amx/vnni':>9}")
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k) * 0.05).bfloat16()
        packed, vnni = fused_ops.pack_onednn(w), fused_ops.pack_vnni(w)
        for m in ROWS:
            x = torch.randn(m, k).bfloat16()
            y = x.new_empty(m, n)
            amx = best_seconds(lambda: ops.linear_bf16_amx(y, x, vnni, None), args.repeats) * 1e6
            few = best_seconds(lambda: ops.linear_bf16_vnni(y, x, vnni, None), args.repeats) * 1e6 if m <= 8 else float("nan")
            dnn = best_seconds(lambda: fused_ops.onednn_linear(x, packed, None), args.repeats) * 1e6
            print(f"{name:8} {m:5d} {amx:9.1f} {few:9.1f} {dnn:10.1f} {amx / dnn:11.2f} {amx / few:9.2f}")


if __name__ == "__main__":
    main()
