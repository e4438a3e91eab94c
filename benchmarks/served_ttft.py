"""Which requests make the served TTFT percentiles: vs_vllm.py's load (128 ShareGPT chats, 32 streams, replies
<= 128 tokens, ignore_eos) against `tokenmill serve`, each request's TTFT by group:

- burst: the first `--concurrency` requests, sent at once (they queue behind each other's prompts);
- long: later requests whose prompt has >= 150 tokens before the chat template (shortest-first lets others pass them);
- rest: the later short ones, what a step-time target and the HTTP path decide.

    .venv/bin/python benchmarks/served_ttft.py [--rounds 2] [--old-tree /tmp/old] [--server-args "--dtype bfloat16"]

With --old-tree the servers of the two checkouts alternate, round by round (the old one runs with PYTHONPATH set
to its tree, so build its extension there first). Per run: output tok/s, TTFT p50 over all requests, and p10 / p50
/ p90 per group; medians over the rounds at the end. JSON rows [load index, prompt tokens, sent at s, TTFT s]
per run in --result-dir. From the server's /metrics, means over the load on its own clock: its TTFT (request
tokenized -> the end of the step that gave its first token) and of it the queue (-> first scheduled: the step in flight,
then room in a step) and prefill (-> first token) times; the client's mean TTFT beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.bench.common import SampleRequest, load_sharegpt, medians  # noqa: E402
from tokenmill.bench.serve import LaunchedServer, discover_model, load_tokenizer, run_load, scrape_metrics  # noqa: E402

LONG_PROMPT = 150


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3 if xs else float("nan")


def one_run(
    server_args: list[str], load: list[SampleRequest], concurrency: int, tree: Path | None, log: Path
) -> tuple[dict, list[list[float]]]:
    # the old checkout's server imports that tree's package
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    with LaunchedServer(server_args, log_path=str(log), env=env) as s:
        model = discover_model(s.base_url)
        asyncio.run(
            run_load(
                s.base_url,
                model,
                [SampleRequest(load[0].prompt, load[0].prompt_token_ids, 8)],
                math.inf,
                "poisson",
                None,
                chat=True,
                ignore_eos=True,
            )
        )
        before = scrape_metrics(s.base_url)
        res, dur = asyncio.run(
            run_load(s.base_url, model, load, math.inf, "poisson", concurrency, chat=True, ignore_eos=True)
        )
        after = scrape_metrics(s.base_url)
    failed = [r.error for r in res if not r.success]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed: {failed[0]}")
    t0 = min(r.start_time for r in res)
    rows = [[i, r.prompt_len, r.start_time - t0, r.ttft] for i, r in enumerate(res)]
    order = sorted(rows, key=lambda x: x[2])
    burst, later = order[:concurrency], order[concurrency:]
    groups = {
        "burst": [x[3] for x in burst],
        "long": [x[3] for x in later if x[1] >= LONG_PROMPT],
        "rest": [x[3] for x in later if x[1] < LONG_PROMPT],
    }
    out = {"out_tok_s": sum(r.output_tokens for r in res) / dur, "ttft_p50_ms": q([x[3] for x in rows], 0.5)}
    # the server's own clock, means over the load: its TTFT (arrival after tokenizing -> end of the first token's
    # step) = queue (-> first scheduled: the step in flight, then room in a step) + prefill (-> first token)
    out["client TTFT mean"] = sum(x[3] for x in rows) / len(rows) * 1e3
    for name, metric in (
        ("server TTFT mean", "time_to_first_token"),
        ("queue mean", "request_queue_time"),
        ("prefill mean", "request_prefill_time"),
    ):
        count, total = (f"tokenmill:{metric}_seconds_{k}" for k in ("count", "sum"))
        n = after.get(count, math.nan) - before.get(count, math.nan)  # nan: an older tree without the histogram
        out[name] = (after.get(total, math.nan) - before.get(total, math.nan)) / n * 1e3 if n else math.nan
    for g, xs in groups.items():
        out[f"{g} n"] = len(xs)
        for p in (0.1, 0.5, 0.9):
            out[f"{g} p{int(p * 100)}"] = q(xs, p)
    return out, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--server-args", default="--dtype bfloat16")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--old-tree", type=Path, default=None, help="another checkout whose server alternates with ours")
    ap.add_argument("--result-dir", default="bench_out/served_ttft")
    args = ap.parse_args()
    tok = load_tokenizer("smollm2-135m")
    load = load_sharegpt(None, tok, args.num_prompts, seed=0, max_output_len=args.max_output_len)
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    trees = {"this tree": None} if args.old_tree is None else {"old": args.old_tree.resolve(), "this tree": None}
    res: dict[str, list[dict]] = {k: [] for k in trees}
    for i in range(args.rounds):
        for name, tree in trees.items():
            m, rows = one_run(
                shlex.split(args.server_args),
                load,
                args.concurrency,
                tree,
                out / f"server-{name.replace(' ', '_')}-{i}.log",
            )
            (out / f"requests-{name.replace(' ', '_')}-{i}.json").write_text(json.dumps(rows))
            res[name].append(m)
            print(name, {k: round(v, 1) for k, v in m.items()}, flush=True)
    print(
        f"\nmedians of {args.rounds} round(s); TTFT in ms; groups: burst = the first {args.concurrency} requests, "
        f"long = later ones with >= {LONG_PROMPT} prompt tokens, rest = the other later ones"
    )
    for name in trees:
        print(name, medians(res[name]))


if __name__ == "__main__":
    main()
