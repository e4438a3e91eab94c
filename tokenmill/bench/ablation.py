"""`tokenmill bench ablation`: turn one technique on at a time on the same workload and print what
it buys here. Rows:

  batching        static batches (a batch runs until its longest request ends; nobody joins) vs
                  paged KV + continuous batching, on the same ShareGPT requests: output tok/s
  chunked prefill N decode streams running while a long prompt arrives: inter-token latency p50/p99
                  with the prompt chunked into the step budget vs prefilled in one step
  prefix caching  requests sharing a long system prompt: throughput and mean TTFT, cache off vs on
  quantization    single-stream decode tok/s of RTN int8 / int4 weight-only checkpoints vs the base
                  dtype (built on the fly with tokenmill.quant; 'not available' without it)
  speculation     single-stream decode tok/s of each --spec-methods config vs plain decoding, in the same
                  process on the same prompts: a copy-heavy prompt (--spec-workload copy) or held-out
                  ShareGPT chats (chat); 'not available' without tokenmill.spec_decode
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
import traceback

from tokenmill.bench.common import (
    add_dataset_args,
    environment,
    format_table,
    requests_from_args,
    set_threads,
    summarize,
    write_json,
)
from tokenmill.bench.engine_runs import (
    PASSAGE,
    engine_kwargs,
    engine_throughput,
    engine_timed_generate,
    make_prompt_ids,
    warm_up,
)
from tokenmill.sampling_params import SamplingParams

ROWS = ("batching", "chunked_prefill", "prefix_caching", "quantization", "speculation")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
"""The speculation row's default method."""
HELD_OUT_ROWS = 1000
"""Rows of the seed-0 ShareGPT shuffle before the corpora of `tokenmill build-datastore` and the draft-head
trainers begin (they answer rows 1000 onward): chat prompts for speculation come from these."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tokenmill.entrypoints.engine_args import add_engine_args

    add_engine_args(p)
    add_dataset_args(p)
    p.set_defaults(num_prompts=32, max_output_len=128)
    g = p.add_argument_group("ablation")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--only", default=",".join(ROWS), help=f"Comma list of rows (default: all of {','.join(ROWS)})")
    g.add_argument("--static-batch-size", type=int, default=16, help="Batch size of the static-batching baseline")
    g.add_argument("--num-streams", type=int, default=16, help="chunked prefill: decode streams running")
    g.add_argument("--long-prompt-len", type=int, default=2000, help="chunked prefill: tokens of the arriving prompt")
    g.add_argument("--chunk-budget", type=int, default=96, help="chunked prefill: max_num_batched_tokens when on")
    g.add_argument("--stream-tokens", type=int, default=160, help="chunked prefill: tokens each stream generates")
    g.add_argument("--shared-prefix-len", type=int, default=512, help="prefix caching: shared prompt tokens")
    g.add_argument("--quantized-model", default=None, help="quantization: an existing GPTQ/AWQ dir to use instead")
    g.add_argument(
        "--spec-methods",
        type=json.loads,
        default={"ngram": NGRAM},
        help="speculation: a JSON object of name -> speculative config, each measured against the same plain "
        f"decoding (default: {json.dumps({'ngram': NGRAM})})",
    )
    g.add_argument(
        "--spec-workload",
        choices=["copy", "chat"],
        default="copy",
        help="speculation: copy (a prompt asking to repeat a passage) or chat (held-out ShareGPT first turns, "
        "rows the datastore and draft heads never saw)",
    )
    g.add_argument("--spec-num-prompts", type=int, default=1, help="speculation: chat prompts (default: 1)")
    g.add_argument("--spec-output-len", type=int, default=128, help="speculation: tokens per prompt (default: 128)")
    g.add_argument("--output-json", default=None)
    g.add_argument("--plot-dir", default="bench_out/ablation", help="where ablation.png goes ('' for none)")


def _llm(args, **overrides):
    from tokenmill import LLM

    llm = LLM(**engine_kwargs(args, **overrides))
    warm_up(llm)
    return llm


# ------------------------------------------------------------------ rows
def ablate_batching(args) -> dict:
    llm = _llm(args, enable_prefix_caching=False)
    requests = requests_from_args(args, llm.tokenizer)
    cont = engine_throughput(llm, requests)
    # Static batching on the same engine: waves of B; every row of a wave generates the wave's
    # longest output (padding work), only requested tokens are counted.
    B = args.static_batch_size
    t0 = time.perf_counter()
    for i in range(0, len(requests), B):
        wave = requests[i : i + B]
        n = max(r.output_len for r in wave)
        llm.generate(
            [{"prompt_token_ids": r.prompt_token_ids} for r in wave],
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
            use_tqdm=False,
        )
    static_s = time.perf_counter() - t0
    n_out = sum(r.output_len for r in requests)
    return {
        "workload": f"{len(requests)} {args.dataset_name} requests, {n_out} output tokens",
        "static_output_tok_s": n_out / static_s,
        "continuous_output_tok_s": cont["output_tok_s"],
        "speedup": cont["output_tok_s"] / (n_out / static_s),
        "static_batch_size": B,
    }


def _itl_under_long_arrival(args, chunked: bool) -> dict:
    """N streams decode `stream_tokens` tokens each; after 1/4 of them a long prompt arrives.
    Every stream gets one token per step, so the step times are the streams' inter-token
    latencies over their whole run (the long prompt's prefill steps are the tail)."""
    long_len = args.long_prompt_len
    budget = args.chunk_budget if chunked else max(long_len + args.num_streams, args.max_num_batched_tokens)
    llm = _llm(
        args,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
        max_num_seqs=max(args.max_num_seqs, args.num_streams + 1),
    )
    eng = llm.engine
    base = make_prompt_ids(llm.tokenizer, 64)
    n_tok = min(args.stream_tokens, eng.max_model_len - len(base) - 1)
    stream_params = SamplingParams(temperature=0.0, max_tokens=n_tok, ignore_eos=True)
    for i in range(args.num_streams):
        eng.add_request(f"s{i}", [base[i % len(base)]] + base[1:], stream_params)
    eng.step()  # prefill of the streams (not an inter-token gap)
    gaps, ttft, t_arrive = [], None, None
    last = time.perf_counter()
    step = 0
    while eng.has_unfinished_requests():
        if step == n_tok // 4:
            t_arrive = time.perf_counter()
            eng.add_request(
                "long",
                make_prompt_ids(llm.tokenizer, long_len),
                SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            )
        outs = eng.step()
        now = time.perf_counter()
        if any(o.request_id.startswith("s") and not o.finished for o in outs):
            gaps.append(now - last)
        last = now
        step += 1
        if (
            ttft is None
            and t_arrive is not None
            and any(o.request_id == "long" and o.outputs[0].token_ids for o in outs)
        ):
            ttft = now - t_arrive
    s = summarize([g * 1e3 for g in gaps])
    return {
        "itl_p50_ms": s["median"],
        "itl_p99_ms": s["p99"],
        "itl_max_ms": max(gaps) * 1e3,
        "p99_over_p50": s["p99"] / s["median"],
        "max_over_p50": max(gaps) * 1e3 / s["median"],
        "long_prompt_ttft_ms": (ttft or float("nan")) * 1e3,
        "max_num_batched_tokens": budget,
        "num_gaps": len(gaps),
    }


def ablate_chunked_prefill(args) -> dict:
    return {
        "workload": f"{args.num_streams} decode streams + one {args.long_prompt_len}-token prompt arriving",
        "off": _itl_under_long_arrival(args, chunked=False),
        "on": _itl_under_long_arrival(args, chunked=True),
    }


def ablate_prefix_caching(args) -> dict:
    out = {}
    for on in (False, True):
        llm = _llm(args, enable_prefix_caching=on)
        prefix = make_prompt_ids(llm.tokenizer, args.shared_prefix_len)
        prompts = [
            {
                "prompt_token_ids": prefix
                + llm.tokenizer.encode(f" Question {i}: what happened next?", add_special_tokens=False)
            }
            for i in range(args.num_prompts)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        el = time.perf_counter() - t0
        ttfts = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
        out["on" if on else "off"] = {
            "elapsed_s": el,
            "requests_per_s": len(prompts) / el,
            "mean_ttft_ms": sum(ttfts) / len(ttfts) * 1e3,
            "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outs),
        }
    out["workload"] = f"{args.num_prompts} requests sharing a {args.shared_prefix_len}-token prefix, 16 new tokens"
    out["speedup"] = out["on"]["requests_per_s"] / out["off"]["requests_per_s"]
    return out


def _single_stream(args, model: str | None = None, **overrides) -> dict:
    llm = _llm(args, **({"model": model} if model else {}), **overrides)
    prompt = make_prompt_ids(llm.tokenizer, 32)
    engine_timed_generate(llm.engine, prompt, 8)
    timing, _ = engine_timed_generate(llm.engine, prompt, 128)
    return timing.summary()


def ablate_quantization(args) -> dict:
    for mod in ("tokenmill.quant.pipeline", "tokenmill.quant.save", "tokenmill.quant.loading"):
        if importlib.util.find_spec(mod) is None:
            return {"available": False, "reason": f"{mod} is missing"}
    base = _single_stream(args)
    out = {"base": {"dtype": args.dtype, "decode_tok_s": base["decode_tok_s"]}}
    if args.quantized_model:
        q = _single_stream(args, model=args.quantized_model)
        out[args.quantized_model] = {
            "decode_tok_s": q["decode_tok_s"],
            "speedup": q["decode_tok_s"] / base["decode_tok_s"],
        }
        return out
    import torch

    from tokenmill.models.loader import load_model
    from tokenmill.quant.pipeline import QuantConfig, quantize_model
    from tokenmill.quant.save import save_quantized

    for bits in (8, 4):
        with tempfile.TemporaryDirectory(prefix=f"tm_rtn{bits}_") as tmp:
            loaded = load_model(args.model, dtype=torch.float32, gguf_dequantize=True)  # RTN reads dense weights
            cfg = QuantConfig(method="rtn", bits=bits, group_size=64)
            rep = quantize_model(loaded.model, cfg, None, progress=False)
            save_quantized(
                loaded.model, loaded.config, loaded.tokenizer, rep.weights, cfg.resolved_format, tmp, cfg.sym
            )
            del loaded
            q = _single_stream(args, model=tmp)
        out[f"rtn_int{bits}"] = {"decode_tok_s": q["decode_tok_s"], "speedup": q["decode_tok_s"] / base["decode_tok_s"]}
    return out


def _spec_prompts(args, llm) -> list[list[int]]:
    """The speculation row's prompts: one copy-heavy prompt, or the first --spec-num-prompts held-out ShareGPT
    first turns (chat-templated, at most 256 tokens, and short enough for --spec-output-len more)."""
    if args.spec_workload == "copy":
        text = "Repeat the following text exactly.\n\n" + PASSAGE * 2 + "\n\nRepeated text:\n\n"
        return [llm.tokenizer.encode(text)]
    from tokenmill.bench.common import DEFAULT_SHAREGPT
    from tokenmill.training.eagle import chat_prompt_ids, sharegpt_rows

    longest = min(256, llm.engine.max_model_len - args.spec_output_len)
    prompts = []
    for row in sharegpt_rows(args.dataset or DEFAULT_SHAREGPT)[:HELD_OUT_ROWS]:
        ids = chat_prompt_ids(llm.tokenizer, row["conversations"][0]["value"])
        if 4 <= len(ids) <= longest:
            prompts.append(ids)
        if len(prompts) == args.spec_num_prompts:
            return prompts
    raise ValueError(f"{len(prompts)} held-out chat prompts of <= {longest} tokens; asked for {args.spec_num_prompts}")


def _decode_rate(llm, prompts: list[list[int]], output_len: int) -> float:
    """Batch-1 decode tok/s over the prompts one after another: tokens after the first / their decode time."""
    engine_timed_generate(llm.engine, prompts[0], 8)  # warm-up
    tokens = seconds = 0.0
    for ids in prompts:
        s = engine_timed_generate(llm.engine, ids, output_len)[0].summary()
        tokens += s["num_tokens"] - 1
        seconds += (s["num_tokens"] - 1) / s["decode_tok_s"]
    return tokens / seconds


def ablate_speculation(args) -> dict:
    """Plain decoding, then each --spec-methods config, on the same prompts in this process; each method's
    speedup is over this plain run. Results: "off", one key per method, "methods" (their names, in order) and
    "speedup" (the first method's, as the row had when it ran n-gram only)."""
    if importlib.util.find_spec("tokenmill.spec_decode") is None:
        return {"available": False, "reason": "tokenmill.spec_decode is missing"}
    plain = _llm(args)
    prompts = _spec_prompts(args, plain)
    out: dict = {"off": {"decode_tok_s": _decode_rate(plain, prompts, args.spec_output_len)}}
    del plain
    for name, spec in args.spec_methods.items():
        llm = _llm(args, speculative_config=spec)
        rate = _decode_rate(llm, prompts, args.spec_output_len)
        out[name] = {
            "decode_tok_s": rate,
            "speedup": rate / out["off"]["decode_tok_s"],
            "config": spec,
            "spec_stats": dict(llm.stats().spec_decode),
        }
        del llm
    out["methods"] = list(args.spec_methods)
    out["speedup"] = out[out["methods"][0]]["speedup"] if out["methods"] else float("nan")
    kind = "a copy-heavy prompt" if args.spec_workload == "copy" else f"{len(prompts)} held-out ShareGPT chats"
    out["workload"] = f"batch 1, {kind}, {args.spec_output_len} new tokens each"
    return out


def run_ablation(args) -> dict:
    threads = set_threads(args.num_threads)
    res: dict = {"env": environment(threads), "config": {"model": args.model, "dtype": args.dtype, "threads": threads}}
    wanted = [r.strip() for r in args.only.split(",") if r.strip()]
    for row in wanted:
        if row not in ROWS:
            raise ValueError(f"--only: unknown row {row!r}; rows: {', '.join(ROWS)}")
        fn = globals()[f"ablate_{row}"]
        try:
            res[row] = fn(args)
        except Exception as e:  # one broken row must not hide the others
            res[row] = {
                "available": False,
                "reason": f"failed: {type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=3),
            }
        print(f"{row}: done")
    return res


def print_ablation(res: dict) -> None:
    rows = []
    b = res.get("batching")
    if b and b.get("available", True):
        rows.append(
            [
                "paging + continuous batching",
                b["workload"],
                f"{b['static_output_tok_s']:.1f} -> {b['continuous_output_tok_s']:.1f} out tok/s",
                f"{b['speedup']:.2f}x",
            ]
        )
    c = res.get("chunked_prefill")
    if c and c.get("available", True):
        rows.append(
            [
                "chunked prefill",
                c["workload"],
                f"ITL p99/p50 {c['off']['p99_over_p50']:.1f} -> {c['on']['p99_over_p50']:.1f}, max/p50 "
                f"{c['off']['max_over_p50']:.1f} -> {c['on']['max_over_p50']:.1f} (max {c['off']['itl_max_ms']:.0f}"
                f" -> {c['on']['itl_max_ms']:.0f} ms)",
                f"{c['off']['itl_max_ms'] / c['on']['itl_max_ms']:.2f}x lower max",
            ]
        )
    p = res.get("prefix_caching")
    if p and p.get("available", True):
        rows.append(
            [
                "prefix caching",
                p["workload"],
                f"TTFT {p['off']['mean_ttft_ms']:.0f} -> {p['on']['mean_ttft_ms']:.0f} ms, "
                f"{p['off']['requests_per_s']:.2f} -> {p['on']['requests_per_s']:.2f} req/s",
                f"{p['speedup']:.2f}x",
            ]
        )
    q = res.get("quantization")
    if q and q.get("available", True):
        for k, v in q.items():
            if k != "base":
                rows.append(
                    [
                        f"quantization {k}",
                        "batch 1 decode",
                        f"{q['base']['decode_tok_s']:.1f} -> {v['decode_tok_s']:.1f} tok/s",
                        f"{v['speedup']:.2f}x",
                    ]
                )
    s = res.get("speculation")
    if s and s.get("available", True):
        for name in s["methods"]:
            rows.append(
                [
                    f"speculation ({name})",
                    s["workload"],
                    f"{s['off']['decode_tok_s']:.1f} -> {s[name]['decode_tok_s']:.1f} tok/s",
                    f"{s[name]['speedup']:.2f}x",
                ]
            )
    for name in ROWS:
        r = res.get(name)
        if r is not None and r.get("available") is False:
            rows.append([name, "not available", r["reason"], ""])
    print(format_table(["technique", "workload", "off -> on", "gain"], rows))


def ablation_gains(res: dict) -> list[tuple[str, float]]:
    """(technique, gain) of each row that ran: the factor in the table's last column."""
    gains = []
    if (b := res.get("batching")) and b.get("available", True):
        gains.append(("paging + continuous batching\n(output tok/s)", b["speedup"]))
    if (c := res.get("chunked_prefill")) and c.get("available", True):
        gains.append(("chunked prefill\n(lower max ITL)", c["off"]["itl_max_ms"] / c["on"]["itl_max_ms"]))
    if (p := res.get("prefix_caching")) and p.get("available", True):
        gains.append(("prefix caching\n(req/s)", p["speedup"]))
    if (q := res.get("quantization")) and q.get("available", True):
        gains += [(f"quantization {k}\n(batch-1 tok/s)", v["speedup"]) for k, v in q.items() if k != "base"]
    if (s := res.get("speculation")) and s.get("available", True):
        gains += [(f"{name} speculation\n(batch-1 tok/s)", s[name]["speedup"]) for name in s["methods"]]
    return gains


def plot_ablation(res: dict, out_dir: str | None) -> str | None:
    """ablation.png in out_dir: each technique's gain as a bar (1x = no gain), or None without matplotlib."""
    gains = ablation_gains(res)
    if not out_dir or not gains:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    from pathlib import Path

    path = Path(out_dir) / "ablation.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 0.55 * len(gains) + 1.2))
    labels, values = [g[0] for g in gains][::-1], [g[1] for g in gains][::-1]
    bars = ax.barh(labels, values, color=["#3fae6a" if v >= 1 else "#e05050" for v in values])
    ax.axvline(1.0, color="#555", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("gain, technique on / off (log scale; 1x = none)")
    for bar, v in zip(bars, values):
        ax.text(bar.get_width() * 1.03, bar.get_y() + bar.get_height() / 2, f"{v:.2f}x", va="center", fontsize=8)
    cfg = res.get("config", {})
    ax.set_title(
        f"tokenmill bench ablation: {cfg.get('model')}, {cfg.get('dtype')}, {cfg.get('threads')} threads", fontsize=9
    )
    ax.set_xlim(min(0.8, min(values) * 0.8), max(values) * 1.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def run(args: argparse.Namespace) -> int:
    res = run_ablation(args)
    print_ablation(res)
    png = plot_ablation(res, args.plot_dir)
    if png:
        print(f"plot: {png}")
    write_json(args.output_json, res)
    return 0
