"""`tokenmill bench roofline`: what the hardware allows for decode, and how close we get.

Measured here: memory bandwidth (streaming read of a buffer far larger than the last-level cache,
and a copy) and matmul throughput (fp32 and bf16). Computed: bytes one decode step must read:

    weights   every linear layer + norms + the LM head (for tied embeddings that is the embedding
              matrix, read whole; an untied embedding contributes one row per token)
    KV cache  context_len x kv_bytes_per_token (K and V of every layer), per sequence

Bound on single-stream decode: tok/s <= read_bandwidth / bytes_per_step (the weights dominate at
small context). For a batch of B the weights are read once per step and FLOPs grow with B:
tok/s <= B / max(bytes(B) / bandwidth, 2 * params * B / matmul_flops).
"""
from __future__ import annotations

import argparse
import time

import torch

from tokenmill.bench.common import environment, format_table, set_threads, write_json


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Best-of-n GB/s for a streaming read (sum) and a copy (read + write counted) of num_bytes."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    best_read = best_copy = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best_read = max(best_read, num_bytes / (time.perf_counter() - t))
        t = time.perf_counter()
        y.copy_(x)
        best_copy = max(best_copy, 2 * num_bytes / (time.perf_counter() - t))
    return {"read_gb_s": best_read / 1e9, "copy_gb_s": best_copy / 1e9, "buffer_mib": num_bytes >> 20}


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
        out[f"{name}_tflop_s"] = 2 * n ** 3 / best / 1e12
    return out


def model_bytes(model: torch.nn.Module, arch, dtype_bytes: float) -> dict:
    """Bytes of parameters read per decode step (see module docstring)."""
    weights = 0
    embed = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if "embed_tokens" in name:
            embed = nbytes
            continue
        weights += nbytes
    for name, b in model.named_buffers():   # packed quantized weights live in buffers
        if any(k in name for k in ("qweight", "scales", "qzeros", "weight_packed", "scale")):
            weights += b.numel() * b.element_size()
    tied = getattr(arch, "tie_word_embeddings", False)
    per_step = weights + (embed if tied else embed // arch.vocab_size)
    return {"weight_bytes_per_step": per_step, "embedding_bytes": embed, "tied_embeddings": tied,
            "kv_bytes_per_token": arch.kv_bytes_per_token(dtype_bytes),
            "num_params": sum(p.numel() for p in model.parameters())}


def decode_bound(bw_bytes_s: float, flops_s: float, weight_bytes: int, kv_bytes_per_token: float,
                 num_params: int, batch: int, context: int) -> float:
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
    g.add_argument("--output-json", default=None)


def run_roofline(args: argparse.Namespace) -> dict:
    from tokenmill import LLM
    from tokenmill.bench.engine_runs import engine_kwargs, engine_timed_generate, make_prompt_ids, warm_up
    from tokenmill.bench.latency import measure
    threads = set_threads(args.num_threads)
    bw = measure_bandwidth(args.buffer_mib << 20)
    mm = measure_matmul()
    llm = LLM(**engine_kwargs(args))
    eng = llm.engine
    dtype = eng.config.model.torch_dtype
    elem = torch.empty((), dtype=eng.kv_spec.dtype).element_size()
    mb = model_bytes(eng.model, eng.arch, elem)
    flops = mm["bf16_tflop_s" if dtype == torch.bfloat16 else "fp32_tflop_s"] * 1e12
    ctx = args.input_len + args.output_len // 2   # mean context over the measured run
    bound = decode_bound(bw["read_gb_s"] * 1e9, flops, mb["weight_bytes_per_step"], mb["kv_bytes_per_token"],
                         mb["num_params"], 1, ctx)
    res = {"config": {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "threads": threads,
                      "input_len": args.input_len, "output_len": args.output_len},
           "env": environment(threads), "bandwidth": bw, "matmul": mm, "model": mb,
           "single_stream_bound_tok_s": bound,
           "batch_bounds_tok_s": {f"B={b},ctx=512": decode_bound(bw["read_gb_s"] * 1e9, flops,
                                                                   mb["weight_bytes_per_step"],
                                                                   mb["kv_bytes_per_token"], mb["num_params"], b, 512)
                                  for b in (1, 4, 16, 64)}}
    if not args.no_measure_engine:
        warm_up(llm)
        prompt = make_prompt_ids(llm.tokenizer, args.input_len)
        m, _ = measure(lambda ids, n: engine_timed_generate(eng, ids, n), prompt, args.output_len, 3)
        res["measured_decode_tok_s"] = m["decode_tok_s"]
        res["fraction_of_bound"] = m["decode_tok_s"] / bound
    return res


def print_roofline(res: dict) -> None:
    bw, mm, mb = res["bandwidth"], res["matmul"], res["model"]
    print(f"\nmemory: read {bw['read_gb_s']:.1f} GB/s, copy {bw['copy_gb_s']:.1f} GB/s ({bw['buffer_mib']} MiB buffer); "
          f"matmul: fp32 {mm['fp32_tflop_s']:.2f} TFLOP/s, bf16 {mm['bf16_tflop_s']:.2f} TFLOP/s "
          f"({res['config']['threads']} threads)")
    print(f"model: {mb['num_params'] / 1e6:.1f} M params, {mb['weight_bytes_per_step'] / 2**20:.1f} MiB read per "
          f"decode step ({res['config']['dtype']}), KV {mb['kv_bytes_per_token'] / 1024:.1f} KiB/token")
    rows = [["single stream (bound)", res["single_stream_bound_tok_s"]]]
    rows += [[f"bound {k}", v] for k, v in res["batch_bounds_tok_s"].items()]
    if "measured_decode_tok_s" in res:
        rows.append(["single stream (measured)", res["measured_decode_tok_s"]])
        rows.append(["measured / bound", res["fraction_of_bound"]])
    print(format_table(["", "tok/s"], rows))


def run(args: argparse.Namespace) -> int:
    res = run_roofline(args)
    print_roofline(res)
    write_json(args.output_json, res)
    return 0
