"""tokenmill and vLLM's CPU build served one after the other on the same cores, model, dtype, prompts and client.

    bash scripts/setup_vllm_peer.sh            # once: vLLM in ../peers/vllm, the model as an HF dir
    .venv/bin/python benchmarks/vs_vllm.py [--num-prompts 128] [--concurrency 32] [--server-args "..."]

Per engine (tokenmill; vLLM with its default thread binding; vLLM with every core bound):
- **load**: `--num-prompts` ShareGPT first turns from ../shared/data on /v1/chat/completions, streamed,
  temperature 0, ignore_eos, each running to its reference reply's length, all sent at once under a cap of
  `--concurrency` streams (vLLM's `bench serve` metrics: output tok/s, TTFT, TPOT, ITL);
- **single stream**: `--single-requests` prompts one at a time, `--single-output-len` tokens each (TPOT).
Then tokenmill offline (EngineCore in this process, no HTTP) decodes the same single-stream prompts: the
HTTP path's cost per token is server TPOT / offline TPOT.

Both engines see the same prompt tokens (checked: the chat template of the HF directory is the GGUF's, and
one request's usage.prompt_tokens is compared). Results: a table on stdout, JSON and an ITL percentile plot
in --result-dir. vLLM absent: its rows say why and tokenmill still runs.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.bench.common import (SampleRequest, environment, format_table, load_sharegpt,  # noqa: E402
                                    write_json)
from tokenmill.bench.serve import LaunchedServer, calculate_metrics, discover_model, free_port, load_tokenizer, run_load  # noqa: E402
from tokenmill.bench.vllm_peer import (BINDINGS, DEFAULT_VLLM_MODEL, VLLMServer, VLLMServerConfig,  # noqa: E402
                                       vllm_available)

ITL_PERCENTILES = (10, 25, 50, 75, 90, 95, 99, 99.5, 99.9)


def measure(base_url: str, load: list[SampleRequest], single: list[SampleRequest], concurrency: int) -> dict:
    model = discover_model(base_url)
    warm, _ = asyncio.run(run_load(base_url, model, [SampleRequest(load[0].prompt, load[0].prompt_token_ids, 8)],
                                   math.inf, "poisson", None, chat=True, ignore_eos=True))
    if not warm[0].success:
        raise RuntimeError(f"warm-up request to {base_url} failed: {warm[0].error}")
    results, duration = asyncio.run(run_load(base_url, model, load, math.inf, "poisson", concurrency, chat=True,
                                             ignore_eos=True))
    m = calculate_metrics(results, duration, percentiles=ITL_PERCENTILES)
    itls = sorted(g * 1e3 for r in results if r.success for g in r.itl)
    s_results, s_duration = asyncio.run(run_load(base_url, model, single, math.inf, "poisson", 1, chat=True,
                                                 ignore_eos=True))
    s = calculate_metrics(s_results, s_duration)
    return {"model": model, "load": m, "single": s, "itl_sorted_ms": itls[:: max(1, len(itls) // 4000)]}


def offline_single(requests: list[SampleRequest], server_args: list[str]) -> dict:
    """Batch-1 decode in this process, the same chat prompts as the single-stream run: TPOT excludes the first
    token, as over HTTP."""
    from tokenmill import SamplingParams
    from tokenmill.engine.core import EngineCore
    from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    core = EngineCore(engine_config_from_args(parser.parse_args(server_args)))
    tok = core.tokenizer
    tpots = []
    for i, r in enumerate(requests + requests[:1]):  # the first one again at the end; the first run warms up
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": r.prompt}]), add_special_tokens=False)
        core.add_request(f"o{i}", ids, SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
        times = []
        while core.has_unfinished_requests():
            core.step()
            times.append(time.perf_counter())
        if i:
            tpots.append((times[-1] - times[0]) / (len(times) - 1))
    core.close()
    return {"tpot_ms": {"median": statistics.median(tpots) * 1e3, "mean": statistics.fmean(tpots) * 1e3},
            "num_requests": len(tpots)}


def chat_usage(base_url: str, messages: list[dict]) -> dict:
    """usage of a one-token chat completion: both engines must see the same prompt tokens."""
    import httpx
    body = {"model": discover_model(base_url), "messages": messages, "max_tokens": 1, "temperature": 0}
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120).json()["usage"]


def plot_itl(results: dict, path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    qs = [1, 5, 10, 25, 50, 75, 90, 95, 98, 99, 99.5, 99.9]
    for name, r in results.items():
        if not r.get("available", True):
            continue
        xs = r["itl_sorted_ms"]
        if not xs:
            continue
        vals = [xs[min(len(xs) - 1, int(q / 100 * len(xs)))] for q in qs]
        ax.plot(range(len(qs)), vals, "o-", label=name)
    ax.set_xticks(range(len(qs)), [f"p{q:g}" for q in qs], rotation=45)
    ax.set_yscale("log")
    ax.set_ylabel("inter-token latency (ms, log)")
    ax.set_title("ITL percentiles, 32 concurrent chat streams, ShareGPT")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-output-len", type=int, default=None, help="cap reply lengths (a shorter run)")
    p.add_argument("--single-requests", type=int, default=4)
    p.add_argument("--single-output-len", type=int, default=256)
    p.add_argument("--server-args", default="--dtype bfloat16", help="tokenmill serve's engine flags (one string)")
    p.add_argument("--vllm-venv", default=None, help="vLLM's virtualenv (default ../peers/vllm)")
    p.add_argument("--vllm-model", default=str(DEFAULT_VLLM_MODEL), help="the model as an HF directory, for vLLM")
    p.add_argument("--vllm-bindings", default=",".join(BINDINGS), help=f"comma list of {BINDINGS}")
    p.add_argument("--skip-tokenmill", action="store_true")
    p.add_argument("--result-dir", default="bench_out/vs_vllm")
    args = p.parse_args()
    if args.single_requests < 1:
        p.error("--single-requests must be >= 1 (the single-stream rows and the HTTP/offline ratio need one)")
    out = Path(args.result_dir)
    tok = load_tokenizer("smollm2-135m")
    load = load_sharegpt(None, tok, args.num_prompts, seed=0, max_output_len=args.max_output_len)
    single = [SampleRequest(r.prompt, r.prompt_token_ids, args.single_output_len)
              for r in load_sharegpt(None, tok, args.single_requests, seed=1)]
    server_args = shlex.split(args.server_args)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    prompt_tokens: dict[str, int] = {}
    check_msgs = [{"role": "user", "content": load[0].prompt}]
    if not args.skip_tokenmill:
        print("tokenmill: serving ...", flush=True)
        with LaunchedServer(server_args, log_path=str(out / "tokenmill-server.log")) as tm:
            results["tokenmill"] = measure(tm.base_url, load, single, args.concurrency)
            prompt_tokens["tokenmill"] = chat_usage(tm.base_url, check_msgs)["prompt_tokens"]
    reason = vllm_available(args.vllm_venv, args.vllm_model)
    for binding in [b.strip() for b in args.vllm_bindings.split(",") if b.strip()]:
        name = f"vllm ({binding})"
        if reason is not None:
            results[name] = {"available": False, "reason": reason}
            continue
        print(f"{name}: starting (it compiles the model at start: minutes) ...", flush=True)
        cfg = VLLMServerConfig(model_dir=Path(args.vllm_model), binding=binding,
                               venv=Path(args.vllm_venv) if args.vllm_venv else None)
        with VLLMServer(cfg, free_port()) as v:  # NOTE: one engine on the cores at a time
            r = measure(v.base_url, load, single, args.concurrency)
            r["startup_s"] = v.startup_s
            r["threads_log"] = v.log_lines("hreads")[-3:]
            prompt_tokens[name] = chat_usage(v.base_url, check_msgs)["prompt_tokens"]
        results[name] = r
    if len(set(prompt_tokens.values())) > 1:
        print(f"WARNING: the engines tokenized the same chat differently: {prompt_tokens}")
    if not args.skip_tokenmill:
        print("tokenmill offline: batch-1 decode ...", flush=True)
        results["tokenmill offline"] = offline_single(single, server_args)
    rows = []
    for name, r in results.items():
        if name == "tokenmill offline":
            continue
        if not r.get("available", True):
            rows.append([name, "absent: " + r["reason"]] + [""] * 7)
            continue
        m, s = r["load"], r["single"]
        rows.append([name, m["output_throughput"], m["ttft_ms"]["median"], m["itl_ms"]["median"], m["itl_ms"]["p99"],
                     m["tpot_ms"]["median"], s["tpot_ms"]["median"], 1e3 / s["tpot_ms"]["median"], m["failed"]])
    print(f"\n{args.num_prompts} ShareGPT chat requests, {args.concurrency} concurrent streams, temperature 0, "
          "ignore_eos; single stream: "
          f"{args.single_requests} x {args.single_output_len} tokens (latencies in ms)")
    print(format_table(["engine", "out tok/s", "TTFT p50", "ITL p50", "ITL p99", "TPOT p50", "1-stream TPOT",
                        "1-stream tok/s", "failed"], rows))
    summary = ratios(results)
    for k, v in summary.items():
        print(f"{k}: {v:.3g}")
    payload = {"env": environment(), "args": vars(args), "prompt_tokens_check": prompt_tokens, "results": results,
               "summary": summary}
    write_json(out / "vs_vllm.json", payload)
    png = plot_itl({k: v for k, v in results.items() if k != "tokenmill offline"}, out / "itl_percentiles.png")
    if png:
        print(f"wrote {png}")
    return 0


def ratios(results: dict) -> dict[str, float]:
    """The issue's targets as numbers: ours / vLLM's best where vLLM ran."""
    tm = results.get("tokenmill")
    peers = [r for k, r in results.items() if k.startswith("vllm") and r.get("available", True)]
    out: dict[str, float] = {}
    if tm is None:
        return out
    m = tm["load"]
    out["tokenmill ITL p99 / own median"] = m["itl_ms"]["p99"] / m["itl_ms"]["median"]
    off = results.get("tokenmill offline")
    if off:
        out["tokenmill single stream over HTTP / offline (speed)"] = off["tpot_ms"]["median"] / tm["single"]["tpot_ms"]["median"]
    if peers:
        best_tput = max(r["load"]["output_throughput"] for r in peers)
        out["output throughput / vLLM's best"] = m["output_throughput"] / best_tput
        out["ITL p99 / vLLM's best p99"] = m["itl_ms"]["p99"] / min(r["load"]["itl_ms"]["p99"] for r in peers)
        out["TTFT p50 / vLLM's best p50"] = m["ttft_ms"]["median"] / min(r["load"]["ttft_ms"]["median"] for r in peers)
        out["single stream speed / vLLM's best"] = (min(r["single"]["tpot_ms"]["median"] for r in peers)
                                                    / tm["single"]["tpot_ms"]["median"])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
