"""bf16 single-stream decode and 64-prompt offline throughput of this tree against another checkout (an
earlier commit), each in a fresh process with this venv, rounds interleaved, median kept: the same child
as benchmarks/invariance_cost.py.

    git worktree add /tmp/old b426e1e
    .venv/bin/python benchmarks/before_after.py --old-tree /tmp/old --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from invariance_cost import CHILD, prompts_file  # noqa: E402

from tokenmill.bench.common import medians  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-tree", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    data = prompts_file()
    # PYTHONPATH puts the old checkout's package ahead of this tree's editable install
    trees = {"old": {"PYTHONPATH": str(args.old_tree.resolve())}, "this tree": {}}
    res: dict[str, list[dict]] = {k: [] for k in trees}
    for _ in range(args.rounds):
        for name, env in trees.items():
            out = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps({"dtype": "bfloat16"}), data],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=3000,
                cwd=args.old_tree if name == "old" else REPO,
                check=True,
            )
            res[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, res[name][-1], flush=True)
    for name in trees:
        print(name, medians(res[name]))


if __name__ == "__main__":
    main()
