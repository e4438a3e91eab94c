"""Colocated vs disaggregated serving on this machine: what a 2,000-token prompt does to running streams.

    python benchmarks/disagg.py [--streams 16] [--long 4] [--long-len 2000]

Setups (each worker one torch thread, pinned to its own core with taskset; the load generator and the router
share core 1 with the prefill worker, and mostly wait):

    colocated       one `tokenmill serve` on core 0: the long prompts are chunked into its decode steps
    disaggregated   `tokenmill router` -> prefill worker (core 1) -> decode worker (core 0), K/V over gloo

Load: `--streams` requests with short prompts decode `--stream-tokens` tokens each (ignore_eos); once all are
streaming, `--long` prompts of `--long-len` random tokens (no prefix shared) arrive `--gap` seconds apart. Reported:
ITL of the streams (every gap between their streamed chunks) while long prompts are in flight, p50/p99/max; TTFT
of the long prompts; and from the decode worker's /metrics, the bytes, blocks and time of the K/V pulls. Both
setups run in one invocation, so the ratios compare like with like on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tokenmill.bench.common import percentile, stop_process  # noqa: E402
from tokenmill.bench.serve import free_port, parse_sse_line  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def launch(cmd: list[str], core: int, log: Path, health: str, timeout: float = 300.0) -> subprocess.Popen:
    env = dict(os.environ, TOKENMILL_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        ["taskset", "-c", str(core), sys.executable, "-m", "tokenmill.entrypoints.cli", *cmd],
        cwd=REPO,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(health, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{cmd[0]} did not become healthy: {log.read_text()[-2000:]}")


def serve_cmd(port: int, *extra: str) -> list[str]:
    return [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        "smollm2-135m",
        "--max-model-len",
        "2304",
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "512",
        "--kv-cache-memory-bytes",
        str(1 << 30),
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
        *extra,
    ]


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": "smollm2-135m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            p = parse_sse_line(line)
            if p is None or p == "[DONE]":
                continue
            if p.get("choices") and p["choices"][0].get("text"):
                times.append(time.perf_counter())
    return {"start": t0, "times": times}


async def workload(url: str, args, rng: random.Random) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        shorts = [[rng.randrange(1000, 40000) for _ in range(args.short_len)] for _ in range(args.streams)]
        longs = [[rng.randrange(1000, 40000) for _ in range(args.long_len)] for _ in range(args.long)]
        tasks = [asyncio.create_task(stream(client, url, p, args.stream_tokens)) for p in shorts]
        await asyncio.sleep(args.warmup)  # the streams are in the decode batch
        long_tasks = []
        for p in longs:
            long_tasks.append(asyncio.create_task(stream(client, url, p, args.long_tokens)))
            await asyncio.sleep(args.gap)
        long_res = await asyncio.gather(*long_tasks)
        window = (min(r["start"] for r in long_res), max(r["times"][-1] for r in long_res))
        short_res = await asyncio.gather(*tasks)
    itl_in, itl_all = [], []
    for r in short_res:
        for a, b in zip(r["times"], r["times"][1:]):
            itl_all.append(b - a)
            if window[0] <= b <= window[1]:
                itl_in.append(b - a)
    return {
        "itl_window": itl_in,
        "itl_all": itl_all,
        "ttft_long": [r["times"][0] - r["start"] for r in long_res],
        "window_s": window[1] - window[0],
    }


def summary(xs: list[float]) -> str:
    ms = [1000 * x for x in xs]
    return f"p50 {percentile(ms, 50):.0f} / p99 {percentile(ms, 99):.0f} / max {max(ms):.0f} ms (n {len(ms)})"


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--short-len", type=int, default=32)
    ap.add_argument("--stream-tokens", type=int, default=320)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--long-tokens", type=int, default=8)
    ap.add_argument("--gap", type=float, default=2.0, help="seconds between long prompts")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of streaming before the first long prompt")
    ap.add_argument("--logs", default="/tmp/tokenmill-disagg")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    os.sched_setaffinity(0, {1})
    results = {}

    # colocated: one worker on core 0
    port = free_port()
    srv = launch(serve_cmd(port), 0, logs / "colocated.log", f"http://127.0.0.1:{port}/health")
    try:
        results["colocated"] = asyncio.run(workload(f"http://127.0.0.1:{port}", args, random.Random(0)))
    finally:
        stop_process(srv, 30)

    # disaggregated: prefill core 1, decode core 0, router core 1
    pp, dp, rp, kv = free_port(), free_port(), free_port(), free_port()
    procs = []
    try:
        procs.append(
            launch(
                serve_cmd(pp, "--kv-role", "prefill", "--kv-transfer-config", json.dumps({"kv_port": kv})),
                1,
                logs / "prefill.log",
                f"http://127.0.0.1:{pp}/health",
            )
        )
        procs.append(
            launch(serve_cmd(dp, "--kv-role", "decode"), 0, logs / "decode.log", f"http://127.0.0.1:{dp}/health")
        )
        procs.append(
            launch(
                [
                    "router",
                    "--port",
                    str(rp),
                    "--prefill",
                    f"http://127.0.0.1:{pp}",
                    "--decode",
                    f"http://127.0.0.1:{dp}",
                    "--min-prefill-tokens",
                    "256",
                ],
                1,
                logs / "router.log",
                f"http://127.0.0.1:{rp}/health",
            )
        )
        results["disaggregated"] = asyncio.run(workload(f"http://127.0.0.1:{rp}", args, random.Random(0)))
        d = f"http://127.0.0.1:{dp}"
        xfer = {
            k: metric(d, f"tokenmill:kv_transfer_{k}_total")
            for k in ("loads", "loads_failed", "blocks_loaded", "bytes_loaded", "load_seconds")
        }
        pre = f"http://127.0.0.1:{pp}"
        xfer |= {f"prefill_{k}": metric(pre, f"tokenmill:kv_transfer_{k}_total") for k in ("sends", "send_seconds")}
        xfer["router_prefill_seconds"] = metric(f"http://127.0.0.1:{rp}", "tokenmill:router_prefill_seconds_total")
        xfer["router_disaggregated"] = metric(f"http://127.0.0.1:{rp}", "tokenmill:router_num_disaggregated_total")
        results["transfer"] = xfer
    finally:
        for p in reversed(procs):
            stop_process(p, 30)

    print(
        f"# {args.streams} streams x {args.stream_tokens} tokens; {args.long} prompts of {args.long_len} tokens, "
        f"{args.gap} s apart; one core per worker"
    )
    print("| setup | stream ITL while long prompts run | stream ITL overall | TTFT of long prompts |")
    print("|---|---|---|---|")
    for name in ("colocated", "disaggregated"):
        r = results[name]
        print(f"| {name} | {summary(r['itl_window'])} | {summary(r['itl_all'])} | {summary(r['ttft_long'])} |")
    x = results["transfer"]
    if x["blocks_loaded"]:
        print(
            f"\ntransfer: {x['loads']:.0f} pulls ({x['loads_failed']:.0f} failed), {x['blocks_loaded']:.0f} blocks, "
            f"{x['bytes_loaded'] / 2**20:.1f} MiB, {1000 * x['load_seconds'] / x['loads']:.1f} ms per pull, "
            f"{1000 * x['load_seconds'] / x['blocks_loaded']:.2f} ms per block "
            f"({x['bytes_loaded'] / x['blocks_loaded'] / 1024:.0f} KiB); of a pull, the gloo send itself "
            f"{1000 * x['prefill_send_seconds'] / max(x['prefill_sends'], 1):.1f} ms (the rest: waiting for the "
            f"prefill worker's step to end, gather, scatter); router prefill hop "
            f"{1000 * x['router_prefill_seconds'] / max(x['router_disaggregated'], 1):.0f} ms per request"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
