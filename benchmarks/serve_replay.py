"""The serving load of benchmarks/vs_vllm.py without HTTP: the same chat prompts through an EngineCore in a closed
loop of `--concurrency` streams (a finished request is replaced by the next), with `tokenmill serve`'s
scheduler defaults. It separates what the engine does from what the server adds, and compares two checkouts.

    .venv/bin/python benchmarks/serve_replay.py [--num-prompts 128] [--max-output-len 128] [--args "--dtype bfloat16"]
    git worktree add /tmp/old HEAD~1 && (cd /tmp/old && python setup.py build_ext --inplace)
    .venv/bin/python benchmarks/serve_replay.py --old-tree /tmp/old --rounds 2

Per run: output tok/s, TTFT in the engine (add_request to first token) p50 / p90, the gap between a stream's
tokens p50 / p99 (a step that gives it a token: its wall time since the previous one), and per kind of step
(decode-only, or with a prompt chunk) the count and mean time, and how many of them the C++ layer loop
served. With --old-tree each checkout runs in a fresh process, rounds interleaved, medians printed.
--steps-out / --requests-out write each step (decode, prompt and draft tokens, forward ms) / each request
(load index, prompt tokens, when it was added, its TTFT) as JSON, to see which steps and which requests make
a percentile.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def replay(args) -> dict:
    from tokenmill import SamplingParams
    from tokenmill.bench.common import load_sharegpt, percentile
    from tokenmill.engine.core import EngineCore
    from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
    from tokenmill.entrypoints.openai.cli import SERVE_DEFAULTS

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    parser.set_defaults(**SERVE_DEFAULTS)
    core = EngineCore(engine_config_from_args(parser.parse_args(shlex.split(args.args))))
    tok = core.tokenizer
    load = load_sharegpt(args.dataset, tok, args.num_prompts, seed=0, max_output_len=args.max_output_len)
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": r.prompt}]), add_special_tokens=False)
        for r in load
    ]
    core.add_request("warm", prompts[0][:64], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()
    loop = core.runner.decode_loop
    served0 = loop.steps_served if loop is not None else 0
    pending = list(range(len(load)))[::-1]
    added: dict[str, float] = {}
    index_of: dict[str, int] = {}
    last: dict[str, float] = {}
    seen: dict[str, int] = {}
    ttft, gaps = [], []
    kinds: dict[str, list[float]] = {"decode-only": [], "with a prompt chunk": []}
    out_tokens = 0
    steps: list[list[float]] = []
    requests: list[list[float]] = []

    def admit(now: float) -> None:
        i = pending.pop()
        rid = f"r{i}"
        core.add_request(rid, prompts[i], SamplingParams(temperature=0, max_tokens=load[i].output_len, ignore_eos=True))
        added[rid] = now
        seen[rid] = 0
        index_of[rid] = i

    t0 = time.perf_counter()
    while pending and len(added) < args.concurrency:  # fill the streams
        admit(t0)
    while core.has_unfinished_requests():
        steps_before = core.num_steps
        outs = core.step()
        now = time.perf_counter()
        for o in outs:
            rid, n = o.request_id, o.outputs[0].num_tokens
            if n > seen[rid]:
                if seen[rid] == 0:
                    ttft.append(now - added[rid])
                    i = index_of[rid]
                    requests.append([i, len(prompts[i]), added[rid] - t0, now - added[rid]])
                else:
                    gaps.append(now - last[rid])
                out_tokens += n - seen[rid]
                seen[rid], last[rid] = n, now
            if o.finished and pending:
                admit(now)
        if core.num_steps > steps_before:  # the step ran the model
            rec = core.recent_steps[-1]
            kinds["with a prompt chunk" if rec.tokens.num_prefill else "decode-only"].append(rec.forward_ms)
            steps.append([rec.tokens.num_decode, rec.tokens.num_prefill, rec.tokens.num_draft, rec.forward_ms])
    wall = time.perf_counter() - t0
    res = {
        "out_tok_s": out_tokens / wall,
        "wall_s": wall,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p90_ms": percentile(ttft, 90) * 1e3,
        "gap_p50_ms": percentile(gaps, 50) * 1e3,
        "gap_p99_ms": percentile(gaps, 99) * 1e3,
        "loop_steps": (loop.steps_served - served0) if loop is not None else 0,
    }
    for k, v in kinds.items():
        res[f"{k}: steps"] = len(v)
        res[f"{k}: mean forward ms"] = statistics.fmean(v) if v else 0.0
    core.close()
    if args.steps_out:
        Path(args.steps_out).write_text(json.dumps(steps))
    if args.requests_out:
        Path(args.requests_out).write_text(json.dumps(requests))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--args", default="--dtype bfloat16", help="engine flags (one string); serve's defaults apply")
    ap.add_argument("--dataset", default=None, help="ShareGPT file (default: ../shared/data's, as vs_vllm.py)")
    ap.add_argument("--old-tree", type=Path, default=None, help="another checkout, run in its own processes")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--steps-out", default=None, help="write [decode, prefill, draft tokens, forward ms] per step (JSON)"
    )
    ap.add_argument(
        "--requests-out", default=None, help="write [load index, prompt tokens, added at s, TTFT s] per request (JSON)"
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dataset is None:  # this tree's default, also for an old checkout elsewhere
        from tokenmill.bench.common import DEFAULT_SHAREGPT

        args.dataset = str(DEFAULT_SHAREGPT)
    if args.child:
        print(json.dumps(replay(args)))
        return
    trees = {"this tree": REPO} if args.old_tree is None else {"old": args.old_tree.resolve(), "this tree": REPO}
    argv = [a for a in sys.argv[1:] if a not in ("--old-tree", str(args.old_tree))] + ["--dataset", args.dataset]
    res: dict[str, list[dict]] = {k: [] for k in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            # PYTHONPATH puts the old checkout's package ahead of this tree's editable install
            env = {**os.environ, "PYTHONPATH": str(tree)} if tree != REPO else dict(os.environ)
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), *argv, "--child"],
                env=env,
                cwd=tree,
                capture_output=True,
                text=True,
                timeout=3000,
            )
            if out.returncode:
                raise SystemExit(f"{name}: {out.stderr[-3000:]}")
            res[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, {k: round(v, 1) for k, v in res[name][-1].items()}, flush=True)
    print(
        f"\n{args.num_prompts} ShareGPT chats, {args.concurrency} streams, replies <= {args.max_output_len} tokens, "
        f"engine flags: {args.args!r}; medians of {args.rounds} round(s)"
    )
    from tokenmill.bench.common import medians

    for name in trees:
        print(name, medians(res[name]))


if __name__ == "__main__":
    main()
