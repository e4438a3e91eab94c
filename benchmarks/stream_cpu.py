"""Server CPU per streamed token against position: one 2,000-token chat stream from `tokenmill serve`, the
server's event-loop thread (HTTP, SSE chunks: what grows if each chunk re-slices the whole reply) read from
/proc/<pid>/task/<pid>/schedstat (ns) every 250 tokens, for this tree and optionally another checkout.

    .venv/bin/python benchmarks/stream_cpu.py [--old-tree /tmp/old]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tokenmill.bench.serve import LaunchedServer  # noqa: E402

WINDOW = 250


def thread_cpu_ns(pid: int, tid: int) -> int:
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])


def process_cpu_ns(pid: int) -> int:
    return sum(thread_cpu_ns(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task"))


def measure(tokens: int) -> dict:
    with LaunchedServer(["--model", "smollm2-135m", "--max-model-len", "4096", "--log-stats-interval", "0"]) as srv:
        pid = srv.proc.pid
        body = {
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        marks: list[tuple[int, int, int]] = []  # (tokens so far, event-loop ns, process ns)
        n = 0
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for c in chunk.get("choices", []):
                    if c.get("delta", {}).get("content"):
                        n += 1  # about one token a chunk at batch 1
                if n and n % WINDOW == 0 and (not marks or marks[-1][0] != n):
                    marks.append((n, thread_cpu_ns(pid, pid), process_cpu_ns(pid)))
    rows = []
    for (n0, a0, p0), (n1, a1, p1) in zip(marks, marks[1:]):
        rows.append(
            {
                "tokens": f"{n0}-{n1}",
                "event_loop_us_per_token": round((a1 - a0) / 1e3 / (n1 - n0), 1),
                "process_ms_per_token": round((p1 - p0) / 1e6 / (n1 - n0), 2),
            }
        )
    return {"chunks_with_text": n, "windows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-tree", type=Path)
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args()
    trees = {"this tree": None}
    if args.old_tree:
        trees = {"old": args.old_tree, **trees}
    for name, tree in trees.items():
        saved = os.environ.get("PYTHONPATH")
        if tree is not None:
            os.environ["PYTHONPATH"] = str(tree.resolve())
        try:
            res = measure(args.tokens)
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
        print(name, json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
