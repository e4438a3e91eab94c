"""bf16 greedy outputs alone vs inside a batch: 16 ShareGPT prompts (5-600 characters), 64 tokens each,
generated together (step budget 64, so prompts are chunked among running decodes), then each alone;
prints how many are token-identical. Run it under the kernel policies to compare:

    .venv/bin/python benchmarks/bf16_invariance.py                          # AMX, per-token attention
    .venv/bin/python benchmarks/bf16_invariance.py --no-batch-invariant     # AMX, tiled prefill
    TOKENMILL_ISA=avx512_bf16 .venv/bin/python benchmarks/bf16_invariance.py --no-batch-invariant  # old
"""

from __future__ import annotations

import argparse

from tokenmill import LLM, SamplingParams
from tokenmill.bench.common import first_turns


def prompts(n: int) -> list[str]:
    return first_turns(n, 5, 600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    rows = prompts(16)
    llm = LLM(
        dtype="bfloat16",
        max_num_batched_tokens=64,
        max_num_seqs=32,
        enable_prefix_caching=False,
        batch_invariant=args.batch_invariant,
    )
    batch = [o.outputs[0].token_ids for o in llm.generate(rows, params, use_tqdm=False)]
    same = sum(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids == b for p, b in zip(rows, batch))
    print(f"batch_invariant={args.batch_invariant}: alone == in a batch of 16 (budget 64) for {same} of 16")


if __name__ == "__main__":
    main()
