"""`tokenmill bench latency`: batch 1 TTFT, decode tokens/s and per-token latency percentiles, with
Hugging Face transformers and llama.cpp on the same model, dtype and thread count."""

from __future__ import annotations

import argparse

from tokenmill.bench import peers
from tokenmill.bench.common import environment, format_table, set_threads, write_json
from tokenmill.bench.engine_runs import (
    common_prefix_len,
    engine_kwargs,
    engine_timed_generate,
    make_prompt_ids,
    warm_up,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tokenmill.entrypoints.engine_args import add_engine_args

    add_engine_args(p)
    g = p.add_argument_group("latency")
    g.add_argument("--input-len", type=int, default=32, help="Prompt tokens (default: 32)")
    g.add_argument("--output-len", type=int, default=128, help="Generated tokens, EOS ignored (default: 128)")
    g.add_argument("--num-iters", type=int, default=3, help="Timed runs per engine; the median run is reported")
    g.add_argument("--num-threads", type=int, default=None, help="torch / llama.cpp threads (default: torch's)")
    g.add_argument("--peers", default="hf,llamacpp", help="Comma list of peers: hf, llamacpp, or none")
    g.add_argument("--output-json", default=None, help="Write the results here")


def median_run(summaries: list[dict]) -> dict:
    by = sorted(summaries, key=lambda s: s["decode_tok_s"])
    out = dict(by[len(by) // 2])
    out["decode_tok_s_runs"] = [s["decode_tok_s"] for s in summaries]
    return out


def measure(gen, prompt_ids: list[int], output_len: int, num_iters: int) -> tuple[dict, list[int]]:
    """gen(prompt_ids, n) -> (StreamTiming, tokens); one warm-up run then num_iters timed runs."""
    gen(prompt_ids, 8)
    runs, toks = [], []
    for _ in range(num_iters):
        timing, toks = gen(prompt_ids, output_len)
        runs.append(timing.summary())
    return median_run(runs), toks


def run_latency(args: argparse.Namespace) -> dict:
    from tokenmill import LLM

    threads = set_threads(args.num_threads)
    llm = LLM(**engine_kwargs(args))
    dtype = llm.engine.config.model.torch_dtype
    warm_up(llm)
    prompt = make_prompt_ids(llm.tokenizer, args.input_len)
    results: dict = {
        "config": {
            "model": args.model,
            "dtype": str(dtype).removeprefix("torch."),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_iters": args.num_iters,
            "threads": threads,
        },
        "env": environment(threads),
    }
    ours, our_toks = measure(
        lambda ids, n: engine_timed_generate(llm.engine, ids, n), prompt, args.output_len, args.num_iters
    )
    results["tokenmill"] = ours
    wanted = {p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"}
    if "hf" in wanted:
        reason = peers.hf_available()
        if reason:
            results["hf"] = peers.absent(reason)
        else:
            hf = peers.HFPeer(args.model, dtype)
            res, hf_toks = measure(hf.timed_generate, prompt, args.output_len, args.num_iters)
            res["greedy_prefix_match"] = common_prefix_len(our_toks, hf_toks)
            results["hf"] = res
            del hf
    if "llamacpp" in wanted:
        reason = peers.llamacpp_available(args.model)
        if reason:
            results["llamacpp"] = peers.absent(reason)
        else:
            lc = peers.LlamaCppPeer(args.model, threads)
            res, _ = measure(lc.timed_generate, prompt, args.output_len, args.num_iters)
            res["precision"] = f"GGUF as shipped ({lc.path.name}: llama.cpp runs its quantized weights)"
            results["llamacpp"] = res
    peers.add_peer_ratios(results, "decode_tok_s")
    return results


def print_latency(results: dict) -> None:
    rows = peers.engine_rows(
        results,
        lambda r: [r["ttft_ms"], r["decode_tok_s"], r["itl_ms"]["median"], r["itl_ms"]["p90"], r["itl_ms"]["p99"]],
        5,
    )
    c = results["config"]
    print(
        f"\nbatch 1, {c['input_len']} prompt tokens, {c['output_len']} new tokens, {c['dtype']}, "
        f"{c['threads']} threads (median of {c['num_iters']} runs)"
    )
    print(format_table(["engine", "TTFT ms", "decode tok/s", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms"], rows))
    peers.print_peer_ratios(results, "decode tok/s")


def run(args: argparse.Namespace) -> int:
    results = run_latency(args)
    print_latency(results)
    write_json(args.output_json, results)
    return 0
