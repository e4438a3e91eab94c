"""Batch-1 decode step time against the prompt's length: what attention over the cached keys costs.

    .venv/bin/python benchmarks/decode_context.py [--lengths 16,140,800,1600] [--engine-args "--dtype bfloat16"]

EngineCore in this process; per prompt length, --rounds rounds of one request generating --tokens tokens
(EOS ignored); the median wall time between steps after the first two. Also prints the decode-attention loop
the kernels run on this CPU (tokenmill._C.decode_kernel) for the model's head shape.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="16,140,800,1600")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--engine-args", default="--dtype bfloat16")
    args = p.parse_args()
    import torch

    from tokenmill import SamplingParams
    from tokenmill.attention import cpu_kernels
    from tokenmill.engine.core import EngineCore
    from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args

    ep = argparse.ArgumentParser()
    add_engine_args(ep)
    core = EngineCore(engine_config_from_args(ep.parse_args(shlex.split(args.engine_args))))
    arch = core.arch
    dtype = core.config.model.torch_dtype
    q = torch.zeros(1, arch.num_attention_heads, arch.head_dim, dtype=dtype)
    cache = torch.zeros(2, 1, 16, arch.num_key_value_heads, arch.head_dim, dtype=dtype)
    print(f"decode-attention loop: {cpu_kernels.decode_kernel(q, cache)}")
    lengths = [int(x) for x in args.lengths.split(",")]
    res: dict[int, list[float]] = {n: [] for n in lengths}
    for rnd in range(args.rounds):
        for n in lengths:
            core.add_request(
                f"r{n}-{rnd}",
                [100 + (i * 7) % 5000 for i in range(n)],
                SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True),
            )
            ts = []
            while core.has_unfinished_requests():
                core.step()
                ts.append(time.perf_counter())
            res[n].append(statistics.median(b - a for a, b in zip(ts[1:], ts[2:])) * 1e3)
    core.close()
    print("| prompt tokens | step ms (median per round) |")
    print("|---|---|")
    for n in lengths:
        print(f"| {n} | {' / '.join(f'{x:.2f}' for x in res[n])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
