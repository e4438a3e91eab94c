"""`tokenmill bench throughput`: offline throughput (every request submitted at once), vLLM's
benchmark_throughput definitions, with Hugging Face transformers (static batches), llama.cpp
(llama-cpp-python, one request at a time) and llama-server (parallel slots, all requests sent at
once) on the same requests, dtype and thread count."""

from __future__ import annotations

import argparse

from tokenmill.bench import peers
from tokenmill.bench.common import (
    add_dataset_args,
    environment,
    format_table,
    requests_from_args,
    set_threads,
    write_json,
)
from tokenmill.bench.engine_runs import engine_kwargs, engine_throughput, warm_up


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tokenmill.entrypoints.engine_args import add_engine_args

    add_engine_args(p)
    add_dataset_args(p)
    g = p.add_argument_group("throughput")
    g.add_argument("--num-threads", type=int, default=None, help="torch / llama.cpp threads (default: torch's)")
    g.add_argument(
        "--peers",
        default="hf,llamacpp,llamaserver",
        help="Comma list of peers: hf, llamacpp, llamaserver, or none (absent ones are reported)",
    )
    g.add_argument("--hf-max-batch-size", type=int, default=64, help="HF static batch size (default: 64)")
    g.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="llama-server binary (default: $TOKENMILL_LLAMA_SERVER, ../shared/tools/llama-server/"
        "llama-server next to the repository, then PATH)",
    )
    g.add_argument(
        "--llama-server-slots",
        type=int,
        default=16,
        help="llama-server --parallel slots, 2048 tokens of KV each (default: 16)",
    )
    g.add_argument("--output-json", default=None, help="Write the results here")


def run_throughput(args: argparse.Namespace) -> dict:
    from tokenmill import LLM

    threads = set_threads(args.num_threads)
    llm = LLM(**engine_kwargs(args))
    dtype = llm.engine.config.model.torch_dtype
    requests = requests_from_args(args, llm.tokenizer)
    warm_up(llm)
    results: dict = {
        "config": {
            "model": args.model,
            "dtype": str(dtype).removeprefix("torch."),
            "dataset": args.dataset_name,
            "num_prompts": len(requests),
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "threads": threads,
        },
        "env": environment(threads),
    }
    results["tokenmill"] = engine_throughput(llm, requests)
    results["tokenmill"]["num_preemptions"] = llm.stats().num_preemptions
    del llm
    wanted = {p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"}
    if "hf" in wanted:
        reason = peers.hf_available()
        results["hf"] = (
            peers.absent(reason)
            if reason
            else peers.HFPeer(args.model, dtype).throughput(requests, args.hf_max_batch_size)
        )
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
                "note": "llama-cpp-python runs one request at a time; the llamaserver peer has parallel slots"
            }
    if "llamaserver" in wanted:
        results["llamaserver"] = llamaserver_throughput(args, requests, threads)
    peers.add_peer_ratios(results, "output_tok_s")
    return results


def llamaserver_throughput(args: argparse.Namespace, requests, threads: int) -> dict:
    """The llama-server peer's figures, or why it is absent. A server that fails to start is reported
    the same way, so the engines already measured are not lost."""
    reason = peers.llamaserver_available(args.model, args.llama_server)
    if reason:
        return peers.absent(reason)
    try:
        server = peers.LlamaServerPeer(args.model, threads, slots=args.llama_server_slots, binary=args.llama_server)
    except RuntimeError as e:
        # One line for the table; the server's log tail goes to the JSON.
        first, *log_tail = (str(e) or type(e).__name__).splitlines()
        return peers.absent(f"llama-server failed to start: {first}") | {"log_tail": log_tail}
    with server:
        return server.throughput(requests) | {"binary": str(server.binary)}


def print_throughput(results: dict) -> None:
    rows = peers.engine_rows(
        results, lambda r: [r["elapsed_s"], r["requests_per_s"], r["output_tok_s"], r["total_tok_s"]], 4
    )
    c = results["config"]
    r0 = results["tokenmill"]
    print(
        f"\n{c['num_prompts']} {c['dataset']} requests ({r0['prompt_tokens']} prompt + {r0['output_tokens']} output "
        f"tokens), {c['dtype']}, {c['threads']} threads"
    )
    print(format_table(["engine", "elapsed s", "req/s", "output tok/s", "total tok/s"], rows))
    peers.print_peer_ratios(results, "output tok/s")
    ls = results.get("llamaserver", {})
    if ls.get("available", True) and "slots" in ls:
        print(f"llama-server: {ls['slots']} parallel slots")
        if ls["num_mismatched_outputs"]:
            print(
                f"WARNING: llama-server returned {ls['num_mismatched_outputs']} outputs of another length than "
                f"requested (its figures count requested tokens); errors: {ls['errors']}"
            )


def run(args: argparse.Namespace) -> int:
    results = run_throughput(args)
    print_throughput(results)
    write_json(args.output_json, results)
    return 0
