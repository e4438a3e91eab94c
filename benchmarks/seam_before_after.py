"""The executor seam (issue 46), before and after, in one run: this tree against an older checkout, each
measurement in a fresh process with this venv, rounds interleaved, median kept.

    plain          bf16 single-stream decode (128 tokens) and 64 ShareGPT prompts at once (replies <= 128 tokens)
    ngram tree     bf16 single stream with the n-gram + datastore token tree (γ 5, <= 12 nodes, width <= 3)
    eagle chain    bf16 single stream with an EAGLE head (γ 3, pinned), and its draft cost ratio c
                   (proposer seconds per drafted token / target step, the adaptive controller's estimate)

    git worktree add /tmp/old 0b07fa0 && (cd /tmp/old && ../main/.venv/bin/python setup.py build_ext --inplace)
    tokenmill build-datastore --out ds.npz && tokenmill train-eagle --out eagle --datastore ds.npz
    .venv/bin/python benchmarks/seam_before_after.py --old-tree /tmp/old --datastore ds.npz --eagle eagle
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from tokenmill.bench.common import first_turns, run_in_tree

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
from tokenmill import LLM, SamplingParams
kw, batch = json.loads(sys.argv[1]), sys.argv[3] == "1"
with open(sys.argv[2]) as f:
    rows = json.load(f)
llm = LLM(dtype="bfloat16", max_model_len=1024, max_num_seqs=64, enable_prefix_caching=False, **kw)
llm.generate([rows[1]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
singles = []
for r in rows[2:6]:   # four prompts, one at a time: tokens after the first / time after the first
    m = llm.generate([r], SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True), use_tqdm=False)[0].metrics
    singles.append((m.num_generation_tokens - 1) / (m.last_token_time - m.first_token_time))
out = {"single_tok_s": sum(singles) / len(singles)}
spec = llm.stats().spec_decode
if spec:
    out["c"] = spec.get("draft_cost_ratio")
    out["acceptance_length"] = spec.get("mean_acceptance_length")
if batch:
    t0 = time.perf_counter()
    outs = llm.generate(rows, SamplingParams(temperature=0.0, max_tokens=128), use_tqdm=False)
    out["batch64_out_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
print(json.dumps(out))
"""


def run(tree: Path, kw: dict, batch: bool, prompts: str) -> dict:
    return run_in_tree(tree, CHILD, [json.dumps(kw), prompts, "1" if batch else "0"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-tree", type=Path, required=True)
    ap.add_argument("--datastore", required=True)
    ap.add_argument("--eagle", required=True, help="an EAGLE head directory (tokenmill train-eagle)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", nargs="+", default=["plain", "ngram tree", "eagle chain"], help="which rows to run")
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(first_turns(64, 5, 2000), f)
    rows = {
        "plain": ({}, True),
        "ngram tree": (
            {
                "speculative_config": {
                    "method": "ngram",
                    "num_speculative_tokens": 5,
                    "datastore": str(Path(args.datastore).resolve()),
                    "tree": {"max_nodes": 12, "max_width": 3},
                }
            },
            False,
        ),
        "eagle chain": (
            {
                "speculative_config": {
                    "method": "eagle",
                    "model": str(Path(args.eagle).resolve()),
                    "num_speculative_tokens": 3,
                    "adaptive": False,
                }
            },
            False,
        ),
    }
    rows = {k: v for k, v in rows.items() if k in args.rows}
    trees = {"old": args.old_tree.resolve(), "new": REPO}
    res: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for name, (kw, batch) in rows.items():
            for label, tree in trees.items():
                r = run(tree, kw, batch, f.name)
                res.setdefault((name, label), []).append(r)
                print(name, label, r, flush=True)
    print("\n| row | metric | old | new | new / old |\n|---|---|---|---|---|")
    for name in rows:
        for metric in ("single_tok_s", "batch64_out_tok_s", "c", "acceptance_length"):
            vals = [[r.get(metric) for r in res[(name, t)]] for t in trees]
            if any(v is None for vs in vals for v in vs):
                continue
            old, new = (statistics.median(v) for v in vals)
            print(f"| {name} | {metric} | {old:.3f} | {new:.3f} | {new / old:.3f} |")


if __name__ == "__main__":
    main()
