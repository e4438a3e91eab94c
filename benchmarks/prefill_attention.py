"""Prefill (TTFT) with the tiled prefill attention kernel vs each prompt token attended as its own
decode, side by side in one process, bf16, the default model.

The per-token path is what prompt chunks used before `paged_prefill` (attention/cpu_kernels.py);
it is selected by raising attention.metadata.TILED_PREFILL_MIN_TOKENS above the prompt length.

    python benchmarks/prefill_attention.py --num-threads 2 --prompt-len 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.num_threads)
    from tokenmill import LLM, SamplingParams
    from tokenmill.attention import metadata as attention_plan

    llm = LLM(
        model="smollm2-135m",
        dtype="bfloat16",
        enable_prefix_caching=False,
        max_num_batched_tokens=max(2048, args.prompt_len),
        max_model_len=max(4096, args.prompt_len + 16),
    )
    rng = random.Random(0)
    prompt = [rng.randrange(100, llm.tokenizer.vocab_size) for _ in range(args.prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt[:64]}], params, use_tqdm=False)  # builds the kernels
    paths = {"per-token decode attention": 10**9, "tiled prefill attention": attention_plan.TILED_PREFILL_MIN_TOKENS}
    times: dict[str, list[float]] = {k: [] for k in paths}
    try:
        for _ in range(args.repeats):
            for name, threshold in paths.items():  # interleaved, so drift hits both
                attention_plan.TILED_PREFILL_MIN_TOKENS = threshold
                t = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                times[name].append(time.perf_counter() - t)
    finally:
        attention_plan.TILED_PREFILL_MIN_TOKENS = paths["tiled prefill attention"]
    print(f"one {args.prompt_len}-token prompt, bf16, {args.num_threads} threads, median of {args.repeats}")
    print("| attention | TTFT ms | prefill tok/s |")
    print("|---|---|---|")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"| {k} | {v * 1e3:.0f} | {args.prompt_len / v:.0f} |")
    print(f"speedup: {med['per-token decode attention'] / med['tiled prefill attention']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
