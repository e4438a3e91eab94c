"""`tokenmill bench roofline`: what the hardware allows for decode, and how close we get.

Measured here: memory bandwidth (streaming read of a buffer far larger than the last-level cache,
and a copy) and matmul throughput (fp32 and bf16). Computed: bytes one decode step must read:

    weights   every linear layer + norms + the LM head (for tied embeddings that is the embedding
              matrix, read whole; an untied embedding contributes one row per token)
    KV cache  context_len x kv_bytes_per_token (K and V of every layer), per sequence

Bound on single-stream decode: tok/s <= read_bandwidth / bytes_per_step (the weights dominate at
small context). For a batch of B the weights are read once per step and FLOPs grow with B:
tok/s <= B / max(bytes(B) / bandwidth, 2 * params * B / matmul_flops).

The read bandwidth is the best of torch's `sum` and a plain AVX-512 load loop on all threads (on
this project's machines `sum` sometimes reads ~25% less than our own GEMV streams, which would
understate the bound), over two buffers: --buffer-mib (1 GiB) and one the size of a decode step's
weights, whichever reads faster (a step re-reads the same bytes each token and may profit from the
last-level cache; the bound must not leave that out). The host's bandwidth also drifts by minutes (42-74 GB/s
over one afternoon here, and single runs that stall for a second per token), so the engine is measured in
--rounds rounds, each a bandwidth measurement followed by three engine runs (their median); the fraction
reported is the median of the per-round fractions.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill import native
from tokenmill.bench.common import environment, format_table, set_threads, write_json
from tokenmill.config import ModelArchConfig


def _read_kernel():
    """The streaming read of csrc/stream_read.cpp, or None without the C++ kernels."""
    ops = native.ops()
    return None if ops is None else ops.stream_read


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Best-of-n GB/s for a streaming read (the better of torch's sum and an AVX-512 load loop) and a
    copy (read + write counted) of num_bytes."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    kernel = _read_kernel()
    best_sum = best_kernel = best_copy = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best_sum = max(best_sum, num_bytes / (time.perf_counter() - t))
        if kernel is not None:
            t = time.perf_counter()
            kernel(x)
            best_kernel = max(best_kernel, num_bytes / (time.perf_counter() - t))
        t = time.perf_counter()
        y.copy_(x)
        best_copy = max(best_copy, 2 * num_bytes / (time.perf_counter() - t))
    return {
        "read_gb_s": max(best_sum, best_kernel) / 1e9,
        "read_sum_gb_s": best_sum / 1e9,
        "read_kernel_gb_s": best_kernel / 1e9 if kernel is not None else None,
        "copy_gb_s": best_copy / 1e9,
        "buffer_mib": num_bytes >> 20,
    }


def measure_matmul(n: int = 2048, repeats: int = 5) -> dict:
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        out[f"{name}_tflop_s"] = 2 * n**3 / best / 1e12
    return out


def model_bytes(model: torch.nn.Module, arch: ModelArchConfig, dtype_bytes: float) -> dict:
    """Bytes of parameters read per decode step (see module docstring)."""
    weights = 0
    embed = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if "embed_tokens" in name:
            embed = nbytes
            continue
        weights += nbytes
    for name, b in model.named_buffers():  # packed quantized weights live in buffers
        if any(k in name for k in ("qweight", "scales", "qzeros", "weight_packed", "scale")):
            weights += b.numel() * b.element_size()
    tied = arch.tie_word_embeddings
    per_step = weights + (embed if tied else embed // arch.vocab_size)
    return {
        "weight_bytes_per_step": per_step,
        "embedding_bytes": embed,
        "tied_embeddings": tied,
        "kv_bytes_per_token": arch.kv_bytes_per_token(dtype_bytes),
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def decode_bound(
    bw_bytes_s: float,
    flops_s: float,
    weight_bytes: int,
    kv_bytes_per_token: float,
    num_params: int,
    batch: int,
    context: int,
) -> float:
    """Upper bound on decode tok/s for `batch` sequences of `context` tokens each."""
    step_bytes = weight_bytes + batch * context * kv_bytes_per_token
    t_mem = step_bytes / bw_bytes_s
    t_flop = 2 * num_params * batch / flops_s
    return batch / max(t_mem, t_flop)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tokenmill.entrypoints.engine_args import add_engine_args

    add_engine_args(p)
    g = p.add_argument_group("roofline")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--input-len", type=int, default=32, help="Prompt tokens of the measured run (default: 32)")
    g.add_argument("--output-len", type=int, default=128, help="New tokens of the measured run (default: 128)")
    g.add_argument("--buffer-mib", type=int, default=1024, help="Bandwidth test buffer (default: 1024 MiB)")
    g.add_argument("--no-measure-engine", action="store_true", help="Only print the bound")
    g.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="Rounds of (bandwidth, then one engine run); the fraction is their median (default: 3)",
    )
    g.add_argument("--output-json", default=None)


def run_roofline(args: argparse.Namespace) -> dict:
    from tokenmill import LLM
    from tokenmill.bench.engine_runs import engine_kwargs, engine_timed_generate, make_prompt_ids, warm_up
    from tokenmill.bench.latency import measure

    threads = set_threads(args.num_threads)
    mm = measure_matmul()
    llm = LLM(**engine_kwargs(args))
    eng = llm.engine
    dtype = eng.config.model.torch_dtype
    elem = torch.empty((), dtype=eng.kv_spec.dtype).element_size()
    mb = model_bytes(eng.model, eng.arch, elem)
    step_bytes = mb["weight_bytes_per_step"]

    def bandwidth() -> dict:
        # The bound's bandwidth is the better of a --buffer-mib read and a read of a buffer the size of
        # one decode step's weights: the step re-reads the same bytes every token, and a buffer of that
        # size profits from the last-level cache as the engine does (here a 270 MiB buffer read ~5%
        # faster than 1 GiB, a 64 MiB one ~55% faster).
        big = measure_bandwidth(args.buffer_mib << 20)
        step = measure_bandwidth(max(step_bytes, 1 << 20) // 64 * 64)
        best = big if big["read_gb_s"] >= step["read_gb_s"] else step
        return {**best, "read_big_buffer_gb_s": big["read_gb_s"], "read_step_size_gb_s": step["read_gb_s"]}

    bw = bandwidth()
    flops = mm["bf16_tflop_s" if dtype == torch.bfloat16 else "fp32_tflop_s"] * 1e12
    ctx = args.input_len + args.output_len // 2  # mean context over the measured run
    bound = decode_bound(
        bw["read_gb_s"] * 1e9, flops, mb["weight_bytes_per_step"], mb["kv_bytes_per_token"], mb["num_params"], 1, ctx
    )
    res = {
        "config": {
            "model": args.model,
            "dtype": str(dtype).removeprefix("torch."),
            "threads": threads,
            "input_len": args.input_len,
            "output_len": args.output_len,
        },
        "env": environment(threads),
        "bandwidth": bw,
        "matmul": mm,
        "model": mb,
        "single_stream_bound_tok_s": bound,
        "batch_bounds_tok_s": {
            f"B={b},ctx=512": decode_bound(
                bw["read_gb_s"] * 1e9,
                flops,
                mb["weight_bytes_per_step"],
                mb["kv_bytes_per_token"],
                mb["num_params"],
                b,
                512,
            )
            for b in (1, 4, 16, 64)
        },
    }
    if not args.no_measure_engine:
        import statistics

        warm_up(llm)
        prompt = make_prompt_ids(llm.tokenizer, args.input_len)
        rounds = []
        for _ in range(max(1, args.rounds)):
            bw_r = bandwidth()
            bound_r = decode_bound(
                bw_r["read_gb_s"] * 1e9,
                flops,
                mb["weight_bytes_per_step"],
                mb["kv_bytes_per_token"],
                mb["num_params"],
                1,
                ctx,
            )
            m, _ = measure(lambda ids, n: engine_timed_generate(eng, ids, n), prompt, args.output_len, 3)
            rounds.append(
                {
                    "read_gb_s": bw_r["read_gb_s"],
                    "bound_tok_s": bound_r,
                    "measured_decode_tok_s": m["decode_tok_s"],
                    "fraction": m["decode_tok_s"] / bound_r,
                }
            )
        res["rounds"] = rounds
        mid = sorted(rounds, key=lambda r: r["fraction"])[len(rounds) // 2]
        res["measured_decode_tok_s"] = mid["measured_decode_tok_s"]
        res["round_bound_tok_s"] = mid["bound_tok_s"]
        res["fraction_of_bound"] = statistics.median(r["fraction"] for r in rounds)
    return res


def print_roofline(res: dict) -> None:
    bw, mm, mb = res["bandwidth"], res["matmul"], res["model"]
    print(
        f"\nmemory: read {bw['read_gb_s']:.1f} GB/s "
        f"(best of a {bw['read_big_buffer_gb_s']:.1f} GB/s big-buffer read and "
        f"{bw['read_step_size_gb_s']:.1f} GB/s over a buffer of one step's bytes; "
        f"torch sum {bw['read_sum_gb_s']:.1f}), "
        f"copy {bw['copy_gb_s']:.1f} GB/s ({bw['buffer_mib']} MiB buffer); "
        f"matmul: fp32 {mm['fp32_tflop_s']:.2f} TFLOP/s, bf16 {mm['bf16_tflop_s']:.2f} TFLOP/s "
        f"({res['config']['threads']} threads)"
    )
    print(
        f"model: {mb['num_params'] / 1e6:.1f} M params, {mb['weight_bytes_per_step'] / 2**20:.1f} MiB read per "
        f"decode step ({res['config']['dtype']}), KV {mb['kv_bytes_per_token'] / 1024:.1f} KiB/token"
    )
    rows = [["single stream (bound)", res["single_stream_bound_tok_s"]]]
    rows += [[f"bound {k}", v] for k, v in res["batch_bounds_tok_s"].items()]
    if "measured_decode_tok_s" in res:
        for i, r in enumerate(res["rounds"]):
            rows.append(
                [
                    f"round {i + 1}: measured / bound ({r['read_gb_s']:.1f} GB/s)",
                    f"{r['measured_decode_tok_s']:.1f} / {r['bound_tok_s']:.1f} = {r['fraction']:.3f}",
                ]
            )
        rows.append(["single stream (measured, median round)", res["measured_decode_tok_s"]])
        rows.append(["measured / bound (median of rounds)", res["fraction_of_bound"]])
    print(format_table(["", "tok/s"], rows))


def run(args: argparse.Namespace) -> int:
    res = run_roofline(args)
    print_roofline(res)
    write_json(args.output_json, res)
    return 0
