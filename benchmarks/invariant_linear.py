"""What a batch-invariant bf16 linear costs: the AMX kernel (one reduction order for every row count,
csrc/gemm_amx.cpp) against the few-row VNNI kernel and oneDNN's prepacked linear, on the default model's
linear shapes and its tied LM head, for 1..512 rows. Best of --repeats, one run, microseconds.

    .venv/bin/python benchmarks/invariant_linear.py --threads 2
    .venv/bin/python benchmarks/invariant_linear.py --threads 2 --cold

--cold: the model's 120 layer linears (30 layers' qkv, o, gate_up, down, 213 MB of bf16 weights) one after
the other, as a forward reads them (from memory, never from cache), through the AMX kernel and oneDNN at
1..128 rows: ms per pass, GB/s of weights and TFLOP/s. On the AMX host (2026-12-06) the AMX kernel streams
~20 GB/s up to 16 rows and slows to ~13 GB/s at 64 and ~8 at 128 rows (1.1 TFLOP/s), while one warm weight
reaches 1.7 TFLOP/s: docs/cpu_decode.md, item 26.
"""

from __future__ import annotations

import argparse

import torch

from tokenmill.bench.common import best_seconds
from tokenmill.layers import fused_ops

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 2, 4, 8, 16, 64, 128, 512)


COLD_ROWS = (1, 16, 32, 48, 64, 96, 128)


def cold(args) -> None:
    """Every layer's weights once per pass, so each read comes from memory, as in a forward."""
    ops = torch.ops.tokenmill
    shapes = [SHAPES[s] for s in ("qkv", "o", "gate_up", "down")] * 30
    ws = [(torch.randn(n, k) * 0.05).bfloat16() for n, k in shapes]
    vnni = [fused_ops.pack_vnni(w) for w in ws]
    packed = [fused_ops.pack_onednn(w) for w in ws]
    nbytes = sum(w.numel() * 2 for w in ws)
    print(f"{'rows':>5} {'amx ms':>8} {'GB/s':>6} {'TFLOP/s':>8} {'onednn ms':>10} {'amx/onednn':>11}")
    for m in COLD_ROWS:
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
        ys = [xs[w.shape[1]].new_empty(m, w.shape[0]) for w in ws]

        def amx(xs=xs, ys=ys):
            for w, v, y in zip(ws, vnni, ys):
                ops.linear_bf16_amx(y, xs[w.shape[1]], v, None)

        def dnn(xs=xs):
            for w, p in zip(ws, packed):
                fused_ops.onednn_linear(xs[w.shape[1]], p, None)

        t_amx = best_seconds(amx, max(3, args.repeats // 4))
        t_dnn = best_seconds(dnn, max(3, args.repeats // 4))
        print(
            f"{m:5d} {t_amx * 1e3:8.2f} {nbytes / t_amx / 1e9:6.1f} {m * nbytes / t_amx / 1e12:8.2f} "
            f"{t_dnn * 1e3:10.2f} {t_amx / t_dnn:11.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cold", action="store_true", help="the model's 120 layer linears in turn (weights from memory)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.cold:
        cold(args)
        return
    ops = torch.ops.tokenmill
    print(f"{'shape':8} {'rows':>5} {'amx us':>9} {'vnni us':>9} {'onednn us':>10} {'amx/onednn':>11} {'amx/vnni':>9}")
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k) * 0.05).bfloat16()
        packed, vnni = fused_ops.pack_onednn(w), fused_ops.pack_vnni(w)
        for m in ROWS:
            x = torch.randn(m, k).bfloat16()
            y = x.new_empty(m, n)
            amx = best_seconds(lambda y=y, x=x, vnni=vnni: ops.linear_bf16_amx(y, x, vnni, None), args.repeats) * 1e6
            few = (
                best_seconds(lambda y=y, x=x, vnni=vnni: ops.linear_bf16_vnni(y, x, vnni, None), args.repeats) * 1e6
                if m <= 8
                else float("nan")
            )
            dnn = best_seconds(lambda x=x, packed=packed: fused_ops.onednn_linear(x, packed, None), args.repeats) * 1e6
            print(f"{name:8} {m:5d} {amx:9.1f} {few:9.1f} {dnn:10.1f} {amx / dnn:11.2f} {amx / few:9.2f}")


if __name__ == "__main__":
    main()
