"""`tokenmill bench serve`: a load generator for any OpenAI-compatible endpoint (ours, vLLM,
llama-server, ...), reporting vLLM's serving-benchmark metrics with its definitions:

- request throughput = completed requests / duration; output (and total) token throughput likewise;
- TTFT: request sent -> first streamed chunk that carries text;
- TPOT (per request, excludes the first token) = (e2e latency - TTFT) / (output tokens - 1);
- ITL: every gap between successive text chunks (a chunk holding k tokens counts once, as in vLLM);
- E2EL: request sent -> last chunk;
- goodput: completed requests per second that meet every given SLO (--goodput ttft:MS tpot:MS e2el:MS).
Each reported as mean, median, std and p99 (plus --metric-percentiles).

Arrivals are Poisson (exponential gaps) or fixed-rate at --request-rate (inf: all at once), under an
optional --max-concurrency cap. Comma lists sweep rates and caps; the result is a table, a JSON file
and PNG plots (latency vs request rate, throughput vs concurrency) in --result-dir.
With --launch-server the command starts `tokenmill serve` on a free local port and stops it at the end;
with --launch-vllm it starts vLLM's CPU build instead (tokenmill.bench.vllm_peer: its own virtualenv; absent,
the JSON says why) with --vllm-dtype and --vllm-binding, and records the log lines that report a fallback.
--client vllm measures with vLLM's own `bench serve` (run by vLLM's interpreter, ShareGPT only, one point per
rate and cap) instead of this module's client, so both engines can be measured by the same foreign client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenmill.bench.common import (
    SampleRequest,
    add_dataset_args,
    environment,
    format_table,
    requests_from_args,
    stop_process,
    summarize,
    write_json,
)
from tokenmill.bench.vllm_peer import (
    BINDINGS,
    DEFAULT_VLLM_MODEL,
    VLLMServer,
    VLLMServerConfig,
    vllm_available,
    vllm_env,
    vllm_python,
)


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    ttft: float = 0.0
    """Seconds from send to the first chunk with text."""
    itl: list[float] = field(default_factory=list)
    """Gaps between successive text chunks, seconds."""
    latency: float = 0.0
    """End-to-end seconds."""
    start_time: float = 0.0
    error: str = ""


def parse_sse_line(line: str) -> dict | None | str:
    """One SSE line -> parsed JSON payload, "[DONE]", or None for comments/blank/other fields."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "[DONE]"
    return json.loads(data)


async def send_request(
    client,
    url: str,
    model: str,
    req: SampleRequest,
    chat: bool,
    ignore_eos: bool,
    extra_body: dict | None = None,
    headers: dict | None = None,
) -> RequestResult:
    """Stream one completion and time its chunks."""
    body: dict = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body or {})
    res = RequestResult(prompt_len=req.prompt_len)
    st = time.perf_counter()
    res.start_time = st
    last = st
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in resp.aiter_lines():
                payload = parse_sse_line(line)
                if payload is None:
                    continue
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                if payload.get("usage"):
                    res.output_tokens = int(payload["usage"].get("completion_tokens") or 0)
                choices = payload.get("choices") or []
                if not choices:
                    continue
                c = choices[0]
                text = c.get("text") if not chat else (c.get("delta") or {}).get("content")
                if text:
                    if res.ttft == 0.0:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                    res.generated_text += text
        res.latency = last - st
        if not res.output_tokens:
            res.output_tokens = chunks  # no usage block: one token per chunk, the best guess
        res.success = res.ttft > 0
        if not res.success:
            res.error = "no text streamed"
    except Exception as e:  # connection errors are results, not crashes
        res.error = f"{type(e).__name__}: {e}"
    return res


async def arrivals(requests: list[SampleRequest], rate: float, pattern: str, seed: int):
    """Yield requests at the given rate: poisson (exponential gaps) or fixed; rate inf = at once."""
    rng = random.Random(seed)
    for i, r in enumerate(requests):
        yield r
        if math.isinf(rate) or i == len(requests) - 1:
            continue
        gap = rng.expovariate(rate) if pattern == "poisson" else 1.0 / rate
        await asyncio.sleep(gap)


async def run_load(
    base_url: str,
    model: str,
    requests: list[SampleRequest],
    rate: float,
    pattern: str,
    max_concurrency: int | None,
    chat: bool = False,
    ignore_eos: bool = False,
    seed: int = 0,
    api_key: str | None = None,
    timeout: float = 600.0,
    extra_body: dict | None = None,
) -> tuple[list[RequestResult], float]:
    import httpx

    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:

        async def one(r: SampleRequest) -> RequestResult:
            if sem is None:
                return await send_request(client, url, model, r, chat, ignore_eos, extra_body, headers)
            async with sem:
                return await send_request(client, url, model, r, chat, ignore_eos, extra_body, headers)

        t0 = time.perf_counter()
        tasks = []
        async for r in arrivals(requests, rate, pattern, seed):
            tasks.append(asyncio.create_task(one(r)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, val = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not val:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS, e2el:MS; got {item!r}")
        slos[key] = float(val)
    return slos


def calculate_metrics(
    results: list[RequestResult],
    duration: float,
    slos: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = (99,),
) -> dict:
    """vLLM's serving metrics (times reported in milliseconds)."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [g for r in ok for g in r.itl]
    e2els = [r.latency for r in ok]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    good = 0
    if slos:
        for r in ok:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            if (
                (r.ttft * 1e3 <= slos.get("ttft", math.inf))
                and (tpot * 1e3 <= slos.get("tpot", math.inf))
                and (r.latency * 1e3 <= slos.get("e2el", math.inf))
            ):
                good += 1
    pcts = tuple(sorted(set(percentiles) | {99}))
    ms = lambda xs: {k: v * 1e3 for k, v in summarize(xs, pcts).items()}  # noqa: E731
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration if duration else float("nan"),
        "request_goodput": good / duration if (slos and duration) else None,
        "output_throughput": n_out / duration if duration else float("nan"),
        "total_token_throughput": (n_in + n_out) / duration if duration else float("nan"),
        "ttft_ms": ms(ttfts),
        "tpot_ms": ms(tpots),
        "itl_ms": ms(itls),
        "e2el_ms": ms(e2els),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


# -------------------------------------------------------------- server life
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`tokenmill serve` as a subprocess on 127.0.0.1:<free port>; stopped on exit."""

    def __init__(
        self,
        server_args: list[str],
        startup_timeout: float = 300.0,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """env: the server process's environment (default: this one's), e.g. PYTHONPATH set to another checkout."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "tokenmill.entrypoints.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *server_args,
        ]
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited with code {self.proc.returncode} during startup")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"tokenmill serve did not become healthy within {timeout:.0f}s")

    def stop(self) -> None:
        stop_process(self.proc, 30)
        if self.log is not subprocess.DEVNULL:
            self.log.close()

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text (a server's /metrics) -> {'name{labels}': value}, plus bare names summed over their label
    sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
        bare = key.split("{", 1)[0]
        out[bare] = out.get(bare, 0.0) + float(value) if bare != key else float(value)
    return out


def scrape_metrics(base_url: str) -> dict[str, float]:
    """A running server's /metrics, as metric_values."""
    import httpx

    return metric_values(httpx.get(base_url.rstrip("/") + "/metrics", timeout=30).text)


def discover_model(base_url: str, api_key: str | None = None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    data = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()
    return data["data"][0]["id"]


# ------------------------------------------------------------------- plots
def write_plots(runs: list[dict], out_dir: Path) -> list[str]:
    """latency vs request rate (one line per concurrency cap) and output throughput vs concurrency
    (one line per rate). Returns the PNG paths written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    caps = sorted({r["max_concurrency"] or 0 for r in runs})
    rates = sorted({r["request_rate"] for r in runs})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    # Rates on a categorical axis (inf last): an unbounded rate has no place on a numeric one.
    rate_pos = {rate: i for i, rate in enumerate(rates)}
    for cap in caps:
        pts = sorted((r for r in runs if (r["max_concurrency"] or 0) == cap), key=lambda r: r["request_rate"])
        xs = [rate_pos[r["request_rate"]] for r in pts]
        label = f"concurrency {cap or 'unbounded'}"
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms", "e2el_ms")):
            ax.plot(xs, [r["metrics"][key]["median"] for r in pts], "o-", label=f"{label} median")
            ax.plot(xs, [r["metrics"][key]["p99"] for r in pts], "x--", label=f"{label} p99")
    for ax, key in zip(axes, ("TTFT", "TPOT", "E2E latency")):
        ax.set_xticks(range(len(rates)), [f"{r:g}" for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{key} (ms)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    p = out_dir / "latency_vs_request_rate.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(str(p))
    fig, ax = plt.subplots(figsize=(6, 4))
    for rate in rates:
        pts = sorted((r for r in runs if r["request_rate"] == rate), key=lambda r: r["max_concurrency"] or 1e9)
        xs = [r["max_concurrency"] or r["num_prompts"] for r in pts]
        ax.plot(xs, [r["metrics"]["output_throughput"] for r in pts], "o-", label=f"rate {rate}")
    ax.set_xlabel("max concurrency (unbounded plotted at num_prompts)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = out_dir / "throughput_vs_concurrency.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(str(p))
    return paths


# --------------------------------------------------------------------- CLI
def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _caps(s: str | None) -> list[int | None]:
    if not s:
        return [None]
    return [None if x.strip() in ("0", "none", "inf") else int(x) for x in s.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default=None, help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    g.add_argument(
        "--launch-server",
        action="store_true",
        help="Start `tokenmill serve` on a free local port for the run and stop it afterwards",
    )
    g.add_argument("--server-args", default="", help="Extra arguments for the launched server (one string)")
    g.add_argument("--model-name", default=None, help="Model name in requests (default: first of /v1/models)")
    g.add_argument("--tokenizer", default="smollm2-135m", help="Tokenizer for prompt lengths (model path or alias)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument(
        "--launch-vllm",
        action="store_true",
        help="Start vLLM's CPU build (scripts/setup_vllm_peer.sh) on a free local port for the run instead",
    )
    g.add_argument("--vllm-dtype", default="bfloat16", help="--launch-vllm: vLLM's --dtype (default: bfloat16)")
    g.add_argument(
        "--vllm-binding",
        choices=BINDINGS,
        default="all-cores",
        help="--launch-vllm: vLLM's own thread binding, or its compute threads bound to every core (default)",
    )
    g.add_argument("--vllm-venv", default=None, help="vLLM's virtualenv (default: ../peers/vllm)")
    g.add_argument(
        "--vllm-model",
        default=str(DEFAULT_VLLM_MODEL),
        help="The model as a Hugging Face directory, for vLLM (its server and its client's tokenizer)",
    )
    g.add_argument(
        "--skip-load-on-fallback",
        action="store_true",
        help="--launch-vllm: after the warm-up request, skip the load when vLLM's log reports a fallback",
    )
    g.add_argument(
        "--client",
        choices=["tokenmill", "vllm"],
        default="tokenmill",
        help="tokenmill: this module's client; vllm: vLLM's own `bench serve` from its virtualenv",
    )
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    g.add_argument("--ignore-eos", action="store_true", help="Send ignore_eos so every request runs to max_tokens")
    add_dataset_args(p)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", default="inf", help="Requests/s, comma list to sweep (inf: all at once)")
    g.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    g.add_argument("--max-concurrency", default=None, help="Cap on requests in flight, comma list to sweep")
    g.add_argument("--goodput", nargs="*", default=None, help="SLOs in ms: ttft:500 tpot:50 e2el:10000")
    g.add_argument("--metric-percentiles", default="99", help="Percentiles to report (comma list)")
    g.add_argument("--result-dir", default="bench_out/serve", help="JSON and PNG plots go here")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument(
        "--share-prefix-cache",
        action="store_true",
        help="Let sweep points share prefix-cache blocks (by default each sends its own cache_salt, so "
        "no point finds an earlier point's prompts cached)",
    )


def load_tokenizer(model: str):
    from tokenmill.models.loader import GGUFSource, HFDirSource, resolve_model_path

    path = resolve_model_path(model)
    return (GGUFSource(path) if path.is_file() else HFDirSource(path)).tokenizer()


def warm_up(base_url: str, model: str, request: SampleRequest, args: argparse.Namespace) -> None:
    """One short request first (vLLM's test run): fails fast on a bad endpoint, warms the server."""
    warm, _ = asyncio.run(
        run_load(
            base_url,
            model,
            [SampleRequest(request.prompt, request.prompt_token_ids, 4)],
            math.inf,
            "poisson",
            None,
            args.endpoint == "chat",
            args.ignore_eos,
            api_key=args.api_key,
        )
    )
    if not warm[0].success:
        raise ValueError(f"test request to {base_url} failed: {warm[0].error}")


def run_vllm_client_sweep(
    base_url: str, model: str, rates: list[float], caps: list[int | None], args: argparse.Namespace, out_dir: Path
) -> list[dict]:
    """Each (cap, rate) point measured by vLLM's own `bench serve`, its result converted to calculate_metrics'
    shape. It samples its own ShareGPT prompts (seed --seed), the same for every server it is pointed at."""
    from tokenmill.bench.common import DEFAULT_SHAREGPT
    from tokenmill.bench.vllm_peer import metrics_from_vllm_result, sharegpt_as_json, vllm_bench_serve_command

    if args.dataset_name != "sharegpt":
        raise ValueError("--client vllm runs ShareGPT prompts only")
    reason = vllm_available(args.vllm_venv, args.vllm_model)
    if reason:
        raise ValueError(f"--client vllm: {reason}")
    out_dir.mkdir(parents=True, exist_ok=True)
    source = Path(args.dataset) if args.dataset else DEFAULT_SHAREGPT
    dataset = source if source.suffix == ".json" else sharegpt_as_json(source, out_dir / "sharegpt.json")
    runs: list[dict] = []
    for cap in caps:
        for rate in rates:
            name = f"vllm-client-{len(runs)}.json"
            cmd = vllm_bench_serve_command(
                vllm_python(args.vllm_venv),
                base_url,
                model,
                Path(args.vllm_model),
                dataset,
                out_dir,
                name,
                chat=args.endpoint == "chat",
                num_prompts=args.num_prompts,
                output_len=args.output_len,
                request_rate=rate,
                max_concurrency=cap,
                ignore_eos=args.ignore_eos,
                seed=args.seed,
            )
            with open(out_dir / "vllm-client.log", "a") as log:
                done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_env("default"))
            if done.returncode != 0:
                raise RuntimeError(f"vLLM's bench serve exited {done.returncode}; see {out_dir / 'vllm-client.log'}")
            m = metrics_from_vllm_result(json.loads((out_dir / name).read_text()), args.num_prompts)
            runs.append({"request_rate": rate, "max_concurrency": cap, "num_prompts": args.num_prompts, "metrics": m})
            print(
                f"rate {rate} cap {cap or '-'} (vLLM's client): {m['completed']} ok, "
                f"{m['output_throughput']:.1f} out tok/s"
            )
    return runs


def run_sweep(
    base_url: str,
    model: str,
    requests: list[SampleRequest],
    rates: list[float],
    caps: list[int | None],
    args: argparse.Namespace,
) -> list[dict]:
    slos = parse_goodput(args.goodput)
    pcts = tuple(_floats(args.metric_percentiles))
    chat = args.endpoint == "chat"
    runs = []
    for cap in caps:
        for rate in rates:
            # NOTE: every point sends the same prompts; without its own cache_salt (vLLM's field too) each point
            # after the first would find them all in the prefix cache and skip their prefill (seen: 23.9 out
            # tok/s for a cold first point vs 111 for the same load later)
            extra = None if args.share_prefix_cache else {"cache_salt": f"sweep-{len(runs)}-{time.time_ns()}"}
            results, duration = asyncio.run(
                run_load(
                    base_url,
                    model,
                    requests,
                    rate,
                    args.arrival,
                    cap,
                    chat,
                    args.ignore_eos,
                    args.seed,
                    args.api_key,
                    extra_body=extra,
                )
            )
            m = calculate_metrics(results, duration, slos, pcts)
            runs.append(
                {
                    "request_rate": rate,
                    "max_concurrency": cap,
                    "num_prompts": len(requests),
                    "metrics": m,
                    "per_request": [{k: v for k, v in asdict(r).items() if k != "generated_text"} for r in results],
                }
            )
            print(
                f"rate {rate} cap {cap or '-'}: {m['completed']} ok, {m['failed']} failed, "
                f"{m['output_throughput']:.1f} out tok/s"
            )
    return runs


def print_runs(runs: list[dict], slos: dict[str, float]) -> None:
    headers = [
        "rate",
        "conc",
        "done",
        "req/s",
        "out tok/s",
        "TTFT mean",
        "TTFT med",
        "TTFT p99",
        "TPOT mean",
        "TPOT med",
        "TPOT p99",
        "ITL med",
        "ITL p99",
        "E2EL med",
        "E2EL p99",
    ]
    if slos:
        headers.append("goodput req/s")
    rows = []
    for r in runs:
        m = r["metrics"]
        row = [
            r["request_rate"],
            r["max_concurrency"] or "-",
            m["completed"],
            m["request_throughput"],
            m["output_throughput"],
            m["ttft_ms"]["mean"],
            m["ttft_ms"]["median"],
            m["ttft_ms"]["p99"],
            m["tpot_ms"]["mean"],
            m["tpot_ms"]["median"],
            m["tpot_ms"]["p99"],
            m["itl_ms"]["median"],
            m["itl_ms"]["p99"],
            m["e2el_ms"]["median"],
            m["e2el_ms"]["p99"],
        ]
        if slos:
            row.append(m["request_goodput"])
        rows.append(row)
    print("\n(latencies in ms)")
    print(format_table(headers, rows))


def run(args: argparse.Namespace) -> int:
    if sum(map(bool, (args.base_url, args.launch_server, args.launch_vllm))) != 1:
        raise ValueError("give one of --base-url URL, --launch-server, --launch-vllm")
    out_dir = Path(args.result_dir)
    server_info: dict = {"engine": "vllm" if args.launch_vllm else "tokenmill" if args.launch_server else "external"}
    if args.launch_vllm:
        server_info.update(dtype=args.vllm_dtype, binding=args.vllm_binding)
        reason = vllm_available(args.vllm_venv, args.vllm_model)
        if reason:  # an absent peer is a result, not a failure
            print(f"vLLM absent: {reason}")
            write_json(out_dir / "serve.json", {"available": False, "reason": reason, "server": server_info})
            return 0
    tokenizer = load_tokenizer(args.tokenizer)
    requests = requests_from_args(args, tokenizer)
    rates = _floats(args.request_rate)
    caps = _caps(args.max_concurrency)
    server: LaunchedServer | VLLMServer | None = None
    try:
        if args.launch_server:
            out_dir.mkdir(parents=True, exist_ok=True)
            server = LaunchedServer(shlex.split(args.server_args), log_path=str(out_dir / "server.log"))
            base_url = server.base_url
        elif args.launch_vllm:
            cfg = VLLMServerConfig(
                model_dir=Path(args.vllm_model),
                dtype=args.vllm_dtype,
                binding=args.vllm_binding,
                venv=Path(args.vllm_venv) if args.vllm_venv else None,
            )
            server = VLLMServer(cfg, free_port())
            server_info["startup_s"] = server.startup_s
            base_url = server.base_url
        else:
            base_url = args.base_url
        model = args.model_name or discover_model(base_url, args.api_key)
        warm_up(base_url, model, requests[0], args)
        if isinstance(server, VLLMServer):
            server_info["fallback_lines"] = server.fallback_lines()[-5:]
            server_info["threads_log"] = server.log_lines("hreads")[-3:]
        if server_info.get("fallback_lines") and args.skip_load_on_fallback:
            server_info["load_skipped"] = "the log reports a fallback (--skip-load-on-fallback)"
            print(f"vLLM logs a fallback, load skipped: {server_info['fallback_lines'][-1]}")
            runs: list[dict] = []
        elif args.client == "vllm":
            runs = run_vllm_client_sweep(base_url, model, rates, caps, args, out_dir)
        else:
            runs = run_sweep(base_url, model, requests, rates, caps, args)
    finally:
        if server is not None:
            server.stop()
    slos = parse_goodput(args.goodput)
    print_runs(runs, slos)
    payload = {
        "base_url": base_url,
        "model": model,
        "endpoint": args.endpoint,
        "dataset": args.dataset_name,
        "arrival": args.arrival,
        "client": args.client,
        "server": server_info,
        "goodput_slos_ms": slos,
        "env": environment(),
        "runs": runs,
    }
    write_json(out_dir / "serve.json", payload)
    if not args.no_plots and runs:
        for p in write_plots(runs, out_dir):
            print(f"wrote {p}")
    return 0
