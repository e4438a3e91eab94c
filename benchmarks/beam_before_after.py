"""Beam search before and after it moved onto the public request API (issue 46), in one run: this tree
against an older checkout, each measurement in a fresh process with this venv, rounds interleaved, median kept.

The old runner drove raw sequences inside EngineCore: one decode token per beam per round, forks by block
reference. The new one submits each live beam as an ordinary request (prompt + beam tokens, max_tokens 1,
logprobs 2W) and relies on the prefix cache for the full blocks, so every round recomputes each beam's
partly filled last block. This measures what that costs, and checks that both give the same beams.

    git worktree add /tmp/old <commit> && cp tokenmill/_C*.so /tmp/old/tokenmill/
    .venv/bin/python benchmarks/beam_before_after.py --old-tree /tmp/old
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
from tokenmill import LLM, BeamSearchParams
width, max_tokens = int(sys.argv[2]), int(sys.argv[3])
with open(sys.argv[1]) as f:
    rows = json.load(f)
llm = LLM(dtype="bfloat16", max_model_len=1024, max_num_seqs=64)
llm.beam_search([rows[0]], BeamSearchParams(beam_width=2, max_tokens=4))
t0 = time.perf_counter()
outs = llm.beam_search(rows[1:], BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
dt = time.perf_counter() - t0
# every prompt runs max_tokens rounds of `width` beams (ignore_eos): beam-tokens per second
print(json.dumps({"beam_tok_s": (len(rows) - 1) * width * max_tokens / dt, "seconds": dt,
                  "best": [o.sequences[0].tokens for o in outs]}))
"""


def run(tree: Path, prompts: str, width: int, max_tokens: int) -> dict:
    return run_in_tree(tree, CHILD, [prompts, str(width), str(max_tokens)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-tree", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="prompts searched at once")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(first_turns(args.prompts + 1, 5, 2000), f)
    trees = {"old": args.old_tree.resolve(), "new": REPO}
    res: dict[tuple[int, str], list[dict]] = {}
    for _ in range(args.rounds):
        for w in args.widths:
            for label, tree in trees.items():
                r = run(tree, f.name, w, args.max_tokens)
                res.setdefault((w, label), []).append(r)
                print(w, label, {k: v for k, v in r.items() if k != "best"}, flush=True)
    print("\n| beam width | old beam-tok/s | new beam-tok/s | new / old | same best beams |\n|---|---|---|---|---|")
    for w in args.widths:
        old, new = (statistics.median(r["beam_tok_s"] for r in res[(w, t)]) for t in trees)
        same = all(a["best"] == b["best"] for a, b in zip(res[(w, "old")], res[(w, "new")]))
        print(f"| {w} | {old:.1f} | {new:.1f} | {new / old:.3f} | {same} |")


if __name__ == "__main__":
    main()
