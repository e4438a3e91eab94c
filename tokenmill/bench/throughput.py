"""`tokenmill bench throughput`: offline throughput (every request submitted at once), vLLM's
benchmark_throughput definitions, with Hugging Face transformers (static batches) and llama.cpp
(llama-cpp-python, one request at a time) on the same requests, dtype and thread count."""
from __future__ import annotations

import argparse

from tokenmill.bench import peers
from tokenmill.bench.common import (add_dataset_args, environment, format_table, requests_from_args, set_threads,
                                    write_json)
from tokenmill.bench.engine_runs import engine_kwargs, engine_throughput, warm_up


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tokenmill.entrypoints.engine_args import add_engine_args
    add_engine_args(p)
    add_dataset_args(p)
    g = p.add_argument_group("throughput")
    g.add_argument("--num-threads", type=int, default=None, help="torch / llama.cpp threads (default: torch's)")
    g.add_argument("--peers", default="hf,llamacpp", help="Comma list of peers: hf, llamacpp, or none")
    g.add_argument("--hf-max-batch-size", type=int, default=64, help="HF static batch size (default: 64)")
    g.add_argument("--output-json", default=None, help="Write the results here")


def run_throughput(args: argparse.Namespace) -> dict:
    from tokenmill import LLM
    threads = set_threads(args.num_threads)
    llm = LLM(**engine_kwargs(args))
    dtype = llm.engine.config.model.torch_dtype
    requests = requests_from_args(args, llm.tokenizer)
    warm_up(llm)
    results: dict = {"config": {"model": args.model, "dtype": str(dtype).removeprefix("torch."),
                                "dataset": args.dataset_name, "num_prompts": len(requests),
                                "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                                "threads": threads}, "env": environment(threads)}
    results["tokenmill"] = engine_throughput(llm, requests)
    results["tokenmill"]["num_preemptions"] = llm.stats().num_preemptions
    del llm
    wanted = {p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"}
    if "hf" in wanted:
        reason = peers.hf_available()
        results["hf"] = peers.absent(reason) if reason else \
            peers.HFPeer(args.model, dtype).throughput(requests, args.hf_max_batch_size)
    if "llamacpp" in wanted:
        reason = peers.llamacpp_available(args.model)
        if reason:
            results["llamacpp"] = peers.absent(reason)
        else:
            import time
            lc = peers.LlamaCppPeer(args.model, threads)
            t0 = time.perf_counter()
            for r in requests:
                lc.timed_generate(r.prompt_token_ids, r.output_len)
            results["llamacpp"] = peers.throughput_figures(requests, time.perf_counter() - t0) | {
                "note": "llama-cpp-python runs one request at a time; for parallel slots use bench serve "
                        "against llama-server"}
    peers.add_peer_ratios(results, "output_tok_s")
    return results


def print_throughput(results: dict) -> None:
    rows = peers.engine_rows(results, lambda r: [r["elapsed_s"], r["requests_per_s"], r["output_tok_s"],
                                                 r["total_tok_s"]], 4)
    c = results["config"]
    r0 = results["tokenmill"]
    print(f"\n{c['num_prompts']} {c['dataset']} requests ({r0['prompt_tokens']} prompt + {r0['output_tokens']} output "
          f"tokens), {c['dtype']}, {c['threads']} threads")
    print(format_table(["engine", "elapsed s", "req/s", "output tok/s", "total tok/s"], rows))
    peers.print_peer_ratios(results, "output tok/s")


def run(args: argparse.Namespace) -> int:
    results = run_throughput(args)
    print_throughput(results)
    write_json(args.output_json, results)
    return 0
