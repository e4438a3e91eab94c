"""tokenmill and vLLM's CPU build served one after the other on the same cores, model, dtype, prompts and client.

    bash scripts/setup_vllm_peer.sh            # once: vLLM in ../peers/vllm, the model as an HF dir
    .venv/bin/python benchmarks/vs_vllm.py [--num-prompts 128] [--concurrency 32] [--server-args "..."]

Per engine (tokenmill; vLLM with its default thread binding; vLLM with every core bound):
- **load**: `--num-prompts` ShareGPT first turns from ../shared/data on /v1/chat/completions, streamed,
  temperature 0, ignore_eos, each running to its reference reply's length, all sent at once under a cap of
  `--concurrency` streams (vLLM's `bench serve` metrics: output tok/s, TTFT, TPOT, ITL);
- **single stream**: `--single-requests` prompts one at a time, `--single-output-len` tokens each (TPOT):
  the seed-0 ShareGPT rows right after the load's, checked to lie before row 1000, where the corpora of
  `tokenmill build-datastore` and the draft heads begin (speculation is measured on prompts it never saw).
With `--load-rounds N` the load runs N times per engine, the engines alternating (tokenmill, vLLM, tokenmill, ...:
each server started afresh), and the ratios are taken per round, between runs minutes apart, then their median: on
a host whose speed drifts by 10-20% within an hour, one run of each gives a ratio that moves as much as the
engines differ (0.87x and 1.02x an hour apart on 12-06). The table shows the medians over the rounds.
For tokenmill the single-stream requests alternate with the same request decoded offline (EngineCore in this
process, the server's engine flags, no HTTP; the server idles meanwhile), so HTTP / offline compares pairs
measured a minute apart, not runs minutes apart on a host whose bandwidth drifts. The ratio is the speed over all
pairs (total offline time / total HTTP time, same tokens per request); the median pair ratio is printed too. With
bf16 speculation on a CPU whose bf16 linears are not batch-invariant (AVX-512 without AMX) one request decoded twice
gets different tokens and acceptance (measured: 54 vs 44 steps for 128 tokens), so one pair mixes that luck with
the HTTP path's cost; summing over the pairs averages it. `--single-server-args`
adds a second tokenmill row whose single stream runs on a server with those flags (e.g. n-gram
speculation), paired with offline runs of the same flags.

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

from tokenmill.bench.common import (
    SampleRequest,
    environment,
    format_table,
    load_sharegpt,  # noqa: E402
    write_json,
)
from tokenmill.bench.serve import LaunchedServer, calculate_metrics, discover_model, free_port, load_tokenizer, run_load  # noqa: E402
from tokenmill.bench.vllm_peer import (
    BINDINGS,
    DEFAULT_VLLM_MODEL,
    VLLMServer,
    VLLMServerConfig,  # noqa: E402
    vllm_available,
)

ITL_PERCENTILES = (10, 25, 50, 75, 90, 95, 99, 99.5, 99.9)


def measure_load(base_url: str, load: list[SampleRequest], concurrency: int) -> dict:
    model = discover_model(base_url)
    warm, _ = asyncio.run(
        run_load(
            base_url,
            model,
            [SampleRequest(load[0].prompt, load[0].prompt_token_ids, 8)],
            math.inf,
            "poisson",
            None,
            chat=True,
            ignore_eos=True,
        )
    )
    if not warm[0].success:
        raise RuntimeError(f"warm-up request to {base_url} failed: {warm[0].error}")
    results, duration = asyncio.run(
        run_load(base_url, model, load, math.inf, "poisson", concurrency, chat=True, ignore_eos=True)
    )
    m = calculate_metrics(results, duration, percentiles=ITL_PERCENTILES)
    itls = sorted(g * 1e3 for r in results if r.success for g in r.itl)
    return {"model": model, "load": m, "itl_sorted_ms": itls[:: max(1, len(itls) // 4000)]}


def measure_single(base_url: str, single: list[SampleRequest], offline: OfflineDecoder | None = None) -> dict:
    """One stream, one request at a time; with `offline`, each request is followed by the same one decoded
    offline, and the pairs' TPOTs are kept side by side."""
    model = discover_model(base_url)
    warm, _ = asyncio.run(
        run_load(
            base_url,
            model,
            [SampleRequest(single[0].prompt, single[0].prompt_token_ids, 8)],
            math.inf,
            "poisson",
            1,
            chat=True,
            ignore_eos=True,
        )
    )
    results, pairs = [], []
    for r in single:
        res, _ = asyncio.run(run_load(base_url, model, [r], math.inf, "poisson", 1, chat=True, ignore_eos=True))
        if not res[0].success:
            raise RuntimeError(f"single-stream request to {base_url} failed: {res[0].error}")
        results.extend(res)
        if offline is not None:
            http_tpot = (res[0].latency - res[0].ttft) / (res[0].output_tokens - 1)
            pairs.append({"http_tpot_ms": http_tpot * 1e3, "offline_tpot_ms": offline.tpot(r) * 1e3})
    out = {"single": calculate_metrics(results, sum(x.latency for x in results))}
    if pairs:
        out["pairs"] = pairs
        out["offline_tpot_ms"] = statistics.median(p["offline_tpot_ms"] for p in pairs)
        # every request decodes the same number of tokens both ways, so this is tokens / second over the set
        out["http_over_offline_speed"] = sum(p["offline_tpot_ms"] for p in pairs) / sum(
            p["http_tpot_ms"] for p in pairs
        )
        out["http_over_offline_speed_median_pair"] = statistics.median(
            p["offline_tpot_ms"] / p["http_tpot_ms"] for p in pairs
        )
    return out


class OfflineDecoder:
    """Batch-1 decode in this process with the server's engine flags: TPOT excludes the first token, as
    over HTTP. Built (and warmed) before the server starts; idle while the server runs."""

    def __init__(self, server_args: list[str]) -> None:
        from tokenmill.engine.core import EngineCore
        from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args

        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        self.core = EngineCore(engine_config_from_args(parser.parse_args(server_args)))
        self._n = 0
        self._decode([1, 2, 3, 4], 8)

    def _decode(self, ids: list[int], max_tokens: int) -> float:
        from tokenmill import SamplingParams

        self._n += 1
        self.core.add_request(f"o{self._n}", ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        times, tokens = [], 0
        while self.core.has_unfinished_requests():
            outs = self.core.step()
            if outs:  # cumulative outputs: the request's tokens so far
                tokens = sum(c.num_tokens for o in outs for c in o.outputs)
            times.append((time.perf_counter(), tokens))
        (t_first, n_first), (t_last, n_last) = next(x for x in times if x[1] > 0), times[-1]
        return (t_last - t_first) / max(1, n_last - n_first)

    def tpot(self, r: SampleRequest) -> float:
        tok = self.core.tokenizer
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": r.prompt}]), add_special_tokens=False)
        return self._decode(ids, r.output_len)

    def close(self) -> None:
        self.core.close()


def check_held_out(single: list[SampleRequest]) -> None:
    """The single-stream prompts must not be among those whose answers built a datastore or trained a draft
    head (`tokenmill build-datastore` / `train-eagle` / `train-medusa` answer rows 1000 onward of the same
    seed-0 shuffle): speculation measured on its own training answers would be retrieval, not speed."""
    from tokenmill.bench.common import DEFAULT_SHAREGPT
    from tokenmill.training.eagle import sharegpt_rows

    trained = {r["conversations"][0]["value"] for r in sharegpt_rows(DEFAULT_SHAREGPT)[1000:] if r.get("conversations")}
    seen = [r.prompt[:60] for r in single if r.prompt in trained]
    if seen:
        raise SystemExit(f"single-stream prompts overlap the draft corpora (rows >= 1000): {seen}")


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
    p.add_argument(
        "--single-server-args",
        default=None,
        help="also run the single stream on a tokenmill server with these flags (a second row)",
    )
    p.add_argument("--vllm-venv", default=None, help="vLLM's virtualenv (default ../peers/vllm)")
    p.add_argument("--vllm-model", default=str(DEFAULT_VLLM_MODEL), help="the model as an HF directory, for vLLM")
    p.add_argument("--vllm-bindings", default=",".join(BINDINGS), help=f"comma list of {BINDINGS}")
    p.add_argument("--skip-tokenmill", action="store_true")
    p.add_argument("--single-only", action="store_true", help="only the single-stream rows (no load runs)")
    p.add_argument(
        "--load-rounds",
        type=int,
        default=1,
        help="run the load this many times per engine, engines alternating (tokenmill, vLLM, tokenmill, "
        "...); ratios are taken per round, between runs minutes apart, and their median printed",
    )
    p.add_argument("--result-dir", default="bench_out/vs_vllm")
    args = p.parse_args()
    if args.single_requests < 1:
        p.error("--single-requests must be >= 1 (the single-stream rows and the HTTP/offline ratio need one)")
    out = Path(args.result_dir)
    tok = load_tokenizer("smollm2-135m")
    load = load_sharegpt(None, tok, args.num_prompts, seed=0, max_output_len=args.max_output_len)
    single = [
        SampleRequest(r.prompt, r.prompt_token_ids, args.single_output_len)
        for r in load_sharegpt(None, tok, args.num_prompts + args.single_requests, seed=0)[args.num_prompts :]
    ]
    check_held_out(single)
    server_args = shlex.split(args.server_args)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    prompt_tokens: dict[str, int] = {}
    check_msgs = [{"role": "user", "content": load[0].prompt}]
    if not args.skip_tokenmill:
        configs = [("tokenmill", server_args, True)]
        if args.single_server_args is not None:
            configs.append((f"tokenmill ({args.single_server_args})", shlex.split(args.single_server_args), False))
        for name, flags, with_load in configs:
            print(f"{name}: offline engine, then serving ...", flush=True)
            offline = OfflineDecoder(flags)
            try:
                with LaunchedServer(flags, log_path=str(out / f"tokenmill-server-{len(results)}.log")) as tm:
                    r = measure_load(tm.base_url, load, args.concurrency) if with_load and not args.single_only else {}
                    r.update(measure_single(tm.base_url, single, offline))
                    prompt_tokens[name] = chat_usage(tm.base_url, check_msgs)["prompt_tokens"]
            finally:
                offline.close()
            results[name] = r
    reason = vllm_available(args.vllm_venv, args.vllm_model)
    vllm_configs: dict[str, VLLMServerConfig] = {}  # result name -> how its server starts
    for binding in [b.strip() for b in args.vllm_bindings.split(",") if b.strip()]:
        name = f"vllm ({binding})"
        if reason is not None:
            results[name] = {"available": False, "reason": reason}
            continue
        print(f"{name}: starting (it compiles the model at start: minutes) ...", flush=True)
        cfg = vllm_configs[name] = VLLMServerConfig(
            model_dir=Path(args.vllm_model), binding=binding, venv=Path(args.vllm_venv) if args.vllm_venv else None
        )
        with VLLMServer(cfg, free_port()) as v:  # NOTE: one engine on the cores at a time
            r = {} if args.single_only else measure_load(v.base_url, load, args.concurrency)
            r.update(measure_single(v.base_url, single))
            r["startup_s"] = v.startup_s
            r["threads_log"] = v.log_lines("hreads")[-3:]
            prompt_tokens[name] = chat_usage(v.base_url, check_msgs)["prompt_tokens"]
        results[name] = r
    for _ in range(1, args.load_rounds if not args.single_only else 1):  # the load again, engines alternating
        if "load" in results.get("tokenmill", {}):
            with LaunchedServer(server_args, log_path=str(out / "tokenmill-server-rounds.log")) as tm:
                results["tokenmill"].setdefault("load_rounds", [results["tokenmill"]["load"]]).append(
                    measure_load(tm.base_url, load, args.concurrency)["load"]
                )
        for name, cfg in vllm_configs.items():
            r = results[name]
            with VLLMServer(cfg, free_port()) as v:
                again = measure_load(v.base_url, load, args.concurrency)["load"]
            r.setdefault("load_rounds", [r["load"]]).append(again)
    if len(set(prompt_tokens.values())) > 1:
        print(f"WARNING: the engines tokenized the same chat differently: {prompt_tokens}")
    rows = []
    for name, r in results.items():
        if not r.get("available", True):
            rows.append([name, "absent: " + r["reason"]] + [""] * 8)
            continue
        m, s = r.get("load"), r["single"]
        ms = r.get("load_rounds", [m] if m else [])  # with --load-rounds: medians over the rounds
        med = lambda f, ms=ms: statistics.median(f(x) for x in ms)  # noqa: E731
        load_cols = (
            [
                med(lambda x: x["output_throughput"]),
                med(lambda x: x["ttft_ms"]["median"]),
                med(lambda x: x["itl_ms"]["median"]),
                med(lambda x: x["itl_ms"]["p99"]),
                med(lambda x: x["tpot_ms"]["median"]),
            ]
            if ms
            else ["", "", "", "", ""]
        )
        rows.append(
            [
                name,
                *load_cols,
                s["tpot_ms"]["median"],
                1e3 / s["tpot_ms"]["median"],
                r.get("offline_tpot_ms", ""),
                sum(x["failed"] for x in ms) + s["failed"],
            ]
        )
    print(
        f"\n{args.num_prompts} ShareGPT chat requests, {args.concurrency} concurrent streams, temperature 0, "
        f"ignore_eos ({args.load_rounds} round(s), engines alternating; medians); single stream: "
        f"{args.single_requests} x {args.single_output_len} tokens (latencies in ms)"
    )
    print(
        format_table(
            [
                "engine",
                "out tok/s",
                "TTFT p50",
                "ITL p50",
                "ITL p99",
                "TPOT p50",
                "1-stream TPOT",
                "1-stream tok/s",
                "offline TPOT (paired)",
                "failed",
            ],
            rows,
        )
    )
    summary = ratios(results)
    for k, v in summary.items():
        print(f"{k}: {v:.3g}")
    payload = {
        "env": environment(),
        "args": vars(args),
        "prompt_tokens_check": prompt_tokens,
        "results": results,
        "summary": summary,
    }
    write_json(out / "vs_vllm.json", payload)
    png = plot_itl({k: v for k, v in results.items() if "load" in v}, out / "itl_percentiles.png")
    if png:
        print(f"wrote {png}")
    return 0


def ratios(results: dict) -> dict[str, float]:
    """The issue's targets as numbers: ours / vLLM's best where vLLM ran."""
    tm = results.get("tokenmill")
    peers = [r for k, r in results.items() if k.startswith("vllm") and r.get("available", True)]
    ours = {k: r for k, r in results.items() if k.startswith("tokenmill")}
    out: dict[str, float] = {}
    if tm is None:
        return out
    m = tm.get("load")
    if m:
        out["tokenmill ITL p99 / own median"] = m["itl_ms"]["p99"] / m["itl_ms"]["median"]
    for name, r in ours.items():
        if "http_over_offline_speed" in r:
            out[f"{name}: single stream over HTTP / offline (speed over all pairs)"] = r["http_over_offline_speed"]
            out[f"{name}: single stream over HTTP / offline (median pair)"] = r["http_over_offline_speed_median_pair"]
    if peers and m and all("load" in r for r in peers):
        # per round (--load-rounds: the engines' runs of round i are minutes apart), then the median over rounds
        rounds = tm.get("load_rounds", [m])
        per_round: dict[str, list[float]] = {
            "output throughput / vLLM's best": [],
            "ITL p99 / vLLM's best p99": [],
            "TTFT p50 / vLLM's best p50": [],
            "tokenmill ITL p99 / own median": [],
        }
        for i, mi in enumerate(rounds):
            pi = [r.get("load_rounds", [r["load"]])[i] for r in peers if i < len(r.get("load_rounds", [r["load"]]))]
            per_round["tokenmill ITL p99 / own median"].append(mi["itl_ms"]["p99"] / mi["itl_ms"]["median"])
            if not pi:
                continue
            per_round["output throughput / vLLM's best"].append(
                mi["output_throughput"] / max(x["output_throughput"] for x in pi)
            )
            per_round["ITL p99 / vLLM's best p99"].append(mi["itl_ms"]["p99"] / min(x["itl_ms"]["p99"] for x in pi))
            per_round["TTFT p50 / vLLM's best p50"].append(
                mi["ttft_ms"]["median"] / min(x["ttft_ms"]["median"] for x in pi)
            )
        for k, v in per_round.items():
            out[k] = statistics.median(v)
            if len(v) > 1:
                out[f"{k} (rounds: {', '.join(f'{x:.3g}' for x in v)})"] = statistics.median(v)
    if peers:
        best_single = min(r["single"]["tpot_ms"]["median"] for r in peers)
        for name, r in ours.items():
            out[f"{name}: single stream speed / vLLM's best"] = best_single / r["single"]["tpot_ms"]["median"]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
