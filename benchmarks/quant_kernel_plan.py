"""Where each quantized linear's kernel stops beating dequantize-then-matmul: the measurement behind the
row limits of tokenmill/quant/kernels.py (`plan`). Times both paths on the default model's linear shapes
(int4 g64 in the k64 and tinygemm layouts, per-channel int8), bf16 activations, for 1..512 rows, best
of `--repeats`, in one run. Run it on a quiet machine:

    .venv/bin/python benchmarks/quant_kernel_plan.py --threads 2
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tokenmill.bench.common import best_seconds
from tokenmill.layers.linear import Linear
from tokenmill.quant.kernels import install_quantized
from tokenmill.quant.rtn import rtn_quantize_weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def layer_for(n: int, k: int, bits: int, layout: str | None) -> Linear:
    layer = Linear(k, n, bias=False)
    torch.nn.init.normal_(layer.weight, std=0.05)
    qw = rtn_quantize_weight(layer.weight.data.float(), bits, 64 if bits == 4 else -1, sym=bits == 8)
    install_quantized(layer, qw, dtype=torch.bfloat16, int4_layout=layout)
    return layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'method':16} {'shape':10} " + " ".join(f"{m:>6}" for m in ROWS) + "   (kernel time / dequant time)")
    for bits, layout in [(4, "k64"), (4, "tinygemm"), (8, None)]:
        for name, (n, k) in SHAPES.items():
            layer = layer_for(n, k, bits, layout)
            method = layer.quant_method
            ratios = []
            for m in ROWS:
                x = torch.randn(m, k).bfloat16()
                kernel = best_seconds(lambda method=method, layer=layer, x=x: method.run_kernel(layer, x), args.repeats)
                dequant = best_seconds(
                    lambda method=method, layer=layer, x=x: F.linear(x, method.dequantize(layer, x.dtype)), args.repeats
                )
                ratios.append(kernel / dequant)
            label = f"int{bits} {layout or 'channel'}"
            print(f"{label:16} {name:10} " + " ".join(f"{r:6.2f}" for r in ratios))


if __name__ == "__main__":
    main()
