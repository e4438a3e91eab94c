"""What bf16 batch invariance costs, and what the new `--dtype auto` buys: single-stream decode and offline
throughput (64 ShareGPT prompts, replies capped at 128 tokens, every request at once) for

    before      bf16 with the old kernel policy: VNNI / oneDNN linears, tiled prefill attention
                (TOKENMILL_ISA=avx512_bf16 --no-batch-invariant), not batch-invariant
    invariant   bf16, AMX linears for every row count, prompt chunks attended like decodes (the default)
    float32     the old `--dtype auto`

each in a fresh process, rounds interleaved, median kept.

    .venv/bin/python benchmarks/invariance_cost.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from tokenmill.bench.common import first_turns

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "before": ({"TOKENMILL_ISA": "avx512_bf16"}, {"dtype": "bfloat16", "batch_invariant": False}),
    "invariant": ({}, {"dtype": "bfloat16"}),
    "float32": ({}, {"dtype": "float32"}),
}

CHILD = r"""
import json, sys, time
from tokenmill import LLM, SamplingParams
kw = json.loads(sys.argv[1])
with open(sys.argv[2]) as f:  # the prompts, written by the parent (an older tree may lack the helper)
    rows = json.load(f)
llm = LLM(max_model_len=1024, max_num_seqs=64, enable_prefix_caching=False, **kw)
one = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
llm.generate([rows[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
m = llm.generate([rows[0]], one, use_tqdm=False)[0].metrics
single = (m.num_generation_tokens - 1) / (m.last_token_time - m.first_token_time)
t0 = time.perf_counter()
outs = llm.generate(rows, SamplingParams(temperature=0.0, max_tokens=128), use_tqdm=False)
dt = time.perf_counter() - t0
print(json.dumps({"single_tok_s": single, "batch64_out_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt}))
"""


def prompts_file() -> str:
    """The 64 ShareGPT first turns every child runs, as a JSON file."""
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(first_turns(64, 5, 2000), f)
    f.close()
    return f.name


def run(name: str) -> dict:
    env_extra, kw = CONFIGS[name]
    out = subprocess.run(
        [str(REPO / ".venv/bin/python"), "-c", CHILD, json.dumps(kw), prompts_file()],
        env={**os.environ, **env_extra},
        capture_output=True,
        text=True,
        timeout=3600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    args = ap.parse_args()
    results: dict[str, list[dict]] = {c: [] for c in args.configs}
    for _ in range(args.rounds):
        for c in args.configs:
            results[c].append(run(c))
            print(c, json.dumps(results[c][-1]), flush=True)
    print(f"\n{'config':10} {'batch 1 tok/s':>14} {'batch 64 out tok/s':>19}   (median of {args.rounds})")
    base = {k: statistics.median(r[k] for r in results[args.configs[0]]) for k in ("single_tok_s", "batch64_out_tok_s")}
    for c in args.configs:
        med = {k: statistics.median(r[k] for r in results[c]) for k in base}
        print(
            f"{c:10} {med['single_tok_s']:8.1f} ({med['single_tok_s'] / base['single_tok_s']:.2f}x)"
            f" {med['batch64_out_tok_s']:10.1f} ({med['batch64_out_tok_s'] / base['batch64_out_tok_s']:.2f}x)"
        )


if __name__ == "__main__":
    main()
