"""Where the HTTP path's time per token goes: `tokenmill serve` against the same engine offline, in one run.

    .venv/bin/python benchmarks/http_path.py [--server-args "--dtype bfloat16"] [--streams 1,32]

Per scenario (N concurrent chat streams, temperature 0, ignore_eos, fixed output length):
- client: ITL median / p99 and TPOT as the `openai`-style streaming client sees them;
- server, from /metrics counters (tokenmill:engine_steps, engine_step_seconds, engine_forward_seconds):
  wall time per engine step and of it the model runner's part;
- server threads, from /proc/<pid>/task/*/schedstat: CPU per engine step on the event-loop thread (HTTP,
  JSON, SSE), the engine thread with torch's OpenMP workers, and the rest;
- offline: EngineCore in this process, same prompts and lengths: wall time per step.
"Server step / offline step" is what serving costs the engine; "client ITL / server step" is time the
client waits beyond the engine's step (event-loop latency).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

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


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread group: the event loop (the main thread), the engine thread with torch's OpenMP
    workers (they inherit its OS name, "tokenmill-engin"), others."""
    out = {"event_loop": 0.0, "engine": 0.0, "other": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        key = "event_loop" if int(tid) == pid else "engine" if comm.startswith("tokenmill-engi") else "other"
        out[key] += ns / 1e9
    return out


def counters(base_url: str) -> dict[str, float]:
    m = scrape_metrics(base_url)
    return {
        name: m.get(f"tokenmill:{name}_total", math.nan)
        for name in ("engine_steps", "engine_step_seconds", "engine_forward_seconds", "generation_tokens")
    }


def served(server: LaunchedServer, reqs: list[SampleRequest], streams: int) -> dict:
    model = discover_model(server.base_url)
    c0, t0 = counters(server.base_url), thread_cpu(server.proc.pid)
    results, duration = asyncio.run(
        run_load(server.base_url, model, reqs, math.inf, "poisson", streams, chat=True, ignore_eos=True)
    )
    time.sleep(0.6)  # the engine thread refreshes its stats every 0.5 s
    c1, t1 = counters(server.base_url), thread_cpu(server.proc.pid)
    m = calculate_metrics(results, duration)
    steps = c1["engine_steps"] - c0["engine_steps"]
    return {
        "client_itl_ms": m["itl_ms"],
        "client_tpot_ms": m["tpot_ms"],
        "output_tok_s": m["output_throughput"],
        "failed": m["failed"],
        "steps": steps,
        "step_ms": (c1["engine_step_seconds"] - c0["engine_step_seconds"]) / steps * 1e3,
        "forward_ms": (c1["engine_forward_seconds"] - c0["engine_forward_seconds"]) / steps * 1e3,
        "cpu_ms_per_step": {k: (t1[k] - t0[k]) / steps * 1e3 for k in t0},
    }


def offline(server_args: list[str], reqs: list[SampleRequest], streams: int) -> dict:
    from tokenmill import SamplingParams
    from tokenmill.engine.core import EngineCore
    from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    core = EngineCore(engine_config_from_args(parser.parse_args(server_args)))
    tok = core.tokenizer
    ids = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": r.prompt}]), add_special_tokens=False)
        for r in reqs
    ]
    core.add_request("warm", ids[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()
    s0 = core.stats()
    pending = list(range(len(reqs)))
    running = 0
    gaps = []
    last = None
    while pending or core.has_unfinished_requests():
        while pending and running < streams:
            i = pending.pop(0)
            core.add_request(
                f"r{i}", ids[i], SamplingParams(temperature=0, max_tokens=reqs[i].output_len, ignore_eos=True)
            )
            running += 1
        outs = core.step()
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        running -= sum(1 for o in outs if o.finished)
    s1 = core.stats()
    core.close()
    steps = s1.num_steps - s0.num_steps
    return {
        "steps": steps,
        "step_ms": (s1.step_seconds - s0.step_seconds) / steps * 1e3,
        "forward_ms": (s1.forward_seconds - s0.forward_seconds) / steps * 1e3,
        "step_gap_ms_median": statistics.median(gaps) * 1e3,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-args", default="--dtype bfloat16")
    p.add_argument("--streams", default="1,32")
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--result-dir", default="bench_out/http_path")
    args = p.parse_args()
    server_args = shlex.split(args.server_args)
    tok = load_tokenizer("smollm2-135m")
    scenarios = [int(x) for x in args.streams.split(",")]
    work = {
        n: [
            SampleRequest(r.prompt, r.prompt_token_ids, args.output_len)
            for r in load_sharegpt(None, tok, n * args.requests_per_stream, seed=2)
        ]
        for n in scenarios
    }
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"server": {}, "offline": {}}
    with LaunchedServer(server_args, log_path=str(out / "server.log")) as server:
        served(server, work[scenarios[0]][:1], 1)  # warm-up
        for n in scenarios:
            res["server"][n] = served(server, work[n], n)
    for n in scenarios:
        res["offline"][n] = offline(server_args, work[n], n)
    rows = []
    for n in scenarios:
        s, o = res["server"][n], res["offline"][n]
        cpu = s["cpu_ms_per_step"]
        rows.append(
            [
                n,
                s["client_itl_ms"]["median"],
                s["client_tpot_ms"]["median"],
                s["step_ms"],
                s["forward_ms"],
                o["step_ms"],
                o["forward_ms"],
                s["step_ms"] / o["step_ms"],
                s["client_tpot_ms"]["median"] / o["step_ms"],
                cpu["event_loop"],
                cpu["engine"],
                cpu["other"],
            ]
        )
    print(
        format_table(
            [
                "streams",
                "client ITL p50",
                "client TPOT p50",
                "server step",
                "server forward",
                "offline step",
                "offline forward",
                "server/offline step",
                "client TPOT/offline step",
                "CPU loop/step",
                "CPU engine+omp/step",
                "CPU other/step",
            ],
            rows,
        )
    )
    print(
        "(ms; CPU = CPU ms per engine step on the server's event-loop thread, "
        "the engine thread with its OpenMP workers, other threads)"
    )
    write_json(out / "http_path.json", {"env": environment(), "args": vars(args), "results": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
