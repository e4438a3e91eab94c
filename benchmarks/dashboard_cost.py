"""What an open dashboard costs the engine: the same load with /dashboard closed and open, alternating, one server.

    .venv/bin/python benchmarks/dashboard_cost.py [--server-args "--dtype bfloat16"] [--rounds 3] [--pages 2]

Each round runs the same batch of ShareGPT chat requests (N concurrent streams, temperature 0, ignore_eos,
fixed output length; a warm-up run first, so every timed run finds the same prompts in the prefix cache) twice:
once with no dashboard open, once with `--pages` SSE clients reading
/dashboard/stream (what a browser tab does: one update every 0.5 s, each a full engine snapshot). Closed and
open alternate so drift on a shared machine falls on both. Reported per condition: client output tok/s, the
engine's wall time per step (/metrics: engine_step_seconds / engine_steps) and the dashboard updates received.
The ratio open/closed is the cost; the spread between rounds of the same condition is the noise it must beat.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.bench.common import SampleRequest, environment, format_table, load_sharegpt, write_json  # noqa: E402
from tokenmill.bench.serve import (
    LaunchedServer,
    calculate_metrics,
    discover_model,
    load_tokenizer,
    run_load,  # noqa: E402
    scrape_metrics,
)


def step_counters(base_url: str) -> tuple[float, float]:
    m = scrape_metrics(base_url)
    return m.get("tokenmill:engine_steps_total", math.nan), m.get("tokenmill:engine_step_seconds_total", math.nan)


class Pages:
    """`n` dashboard streams read on their own thread and event loop, as browser tabs would, until stop()."""

    def __init__(self, base_url: str, n: int) -> None:
        self.base_url, self.n = base_url, n
        self.updates = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _read(self, client: httpx.AsyncClient) -> None:
        async with client.stream("GET", self.base_url + "/dashboard/stream") as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    self.updates += 1
                    self.bytes += len(line)
                if self._stop.is_set():
                    return

    async def _main(self) -> None:
        async with httpx.AsyncClient(timeout=None) as client:
            tasks = [asyncio.create_task(self._read(client)) for _ in range(self.n)]
            while not self._stop.is_set():
                await asyncio.sleep(0.05)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> Pages:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def one_run(server: LaunchedServer, model: str, reqs: list[SampleRequest], streams: int, pages: int) -> dict:
    s0, t0 = step_counters(server.base_url)
    if pages:
        with Pages(server.base_url, pages) as p:
            results, duration = asyncio.run(
                run_load(server.base_url, model, reqs, math.inf, "poisson", streams, chat=True, ignore_eos=True)
            )
        updates, nbytes = p.updates, p.bytes
    else:
        results, duration = asyncio.run(
            run_load(server.base_url, model, reqs, math.inf, "poisson", streams, chat=True, ignore_eos=True)
        )
        updates = nbytes = 0
    time.sleep(0.6)  # the engine thread refreshes its stats every 0.5 s
    s1, t1 = step_counters(server.base_url)
    m = calculate_metrics(results, duration)
    return {
        "output_tok_s": m["output_throughput"],
        "failed": m["failed"],
        "duration_s": duration,
        "steps": s1 - s0,
        "step_ms": (t1 - t0) / (s1 - s0) * 1e3,
        "updates": updates,
        "update_kib": nbytes / max(updates, 1) / 1024,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-args", default="--dtype bfloat16")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pages", type=int, default=2, help="dashboard streams open in the 'open' condition")
    p.add_argument("--result-dir", default="bench_out/dashboard_cost")
    args = p.parse_args()
    tok = load_tokenizer("smollm2-135m")
    reqs = [
        SampleRequest(r.prompt, r.prompt_token_ids, args.output_len)
        for r in load_sharegpt(None, tok, args.num_prompts, seed=3)
    ]
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"closed": [], "open": []}
    with LaunchedServer(shlex.split(args.server_args), log_path=str(out / "server.log")) as server:
        model = discover_model(server.base_url)
        # NOTE: the warm-up runs the whole batch: every timed run then finds the same prompts in the prefix
        # cache (a first timed run that computed them all would look slower for a reason of its own)
        one_run(server, model, reqs, args.streams, 0)
        for k in range(args.rounds):
            order = ("closed", "open") if k % 2 == 0 else ("open", "closed")
            for cond in order:
                r = one_run(server, model, reqs, args.streams, args.pages if cond == "open" else 0)
                runs[cond].append(r)
                print(
                    f"round {k + 1} {cond:6s}: {r['output_tok_s']:.1f} tok/s, {r['step_ms']:.2f} ms/step, "
                    f"{r['updates']} updates",
                    flush=True,
                )
    rows = []
    med = {}
    for cond in ("closed", "open"):
        tps = [r["output_tok_s"] for r in runs[cond]]
        step = [r["step_ms"] for r in runs[cond]]
        med[cond] = (statistics.median(tps), statistics.median(step))
        rows.append(
            [
                cond,
                med[cond][0],
                min(tps),
                max(tps),
                med[cond][1],
                min(step),
                max(step),
                sum(r["updates"] for r in runs[cond]),
                statistics.mean(r["update_kib"] for r in runs[cond]),
            ]
        )
    print(
        format_table(
            [
                "dashboard",
                "tok/s p50",
                "tok/s min",
                "tok/s max",
                "ms/step p50",
                "ms/step min",
                "ms/step max",
                "updates",
                "KiB/update",
            ],
            rows,
        )
    )
    ratio_tps = med["open"][0] / med["closed"][0]
    ratio_step = med["open"][1] / med["closed"][1]
    print(
        f"open/closed: throughput {ratio_tps:.3f}, step time {ratio_step:.3f} "
        f"({args.pages} page(s), {args.streams} streams, {args.rounds} rounds)"
    )
    write_json(
        out / "dashboard_cost.json",
        {
            "env": environment(),
            "args": vars(args),
            "runs": runs,
            "ratio_throughput": ratio_tps,
            "ratio_step_time": ratio_step,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
