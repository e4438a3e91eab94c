"""`tokenmill bench roofline`: what the hardware allows for decode, and how close we get.

Measured here: memory bandwidth (streaming read of a buffer far larger than the last-level cache,
and a copy) and the FLOP/s of the engine's own linear kernels (each Linear's quant method, the code
decode runs) at the batch in question. Computed: bytes one decode step must read:

    weights   every linear layer + norms + the LM head (for tied embeddings that is the embedding
              matrix, read whole; an untied embedding contributes one row per token)
    KV cache  context_len x kv_bytes_per_token (K and V of every layer), per sequence

Bound on decode (decode_bound, a pure function): for B sequences the weights are read once per step,

    memory bound   tok/s <= B * read_bandwidth / bytes(B)
    compute bound  tok/s <= linear_flops(B) / flops_per_token          (B > 1 only)

and the bound is the lower of the two. At batch 1 the compute bound is left out: one row does two FLOPs
per weight it reads, so decode at batch 1 is bandwidth bound, and leaving a roof out can only raise a bound,
never put a measured rate above it. The compute rate is never torch's own matmul: on an AVX2-only CPU
torch's bf16 matmul ran at ~0.3 GFLOP/s while our AVX2 kernel does 15-72 GFLOP/s, and a bound taken from
torch's claimed 1.16 tok/s for a 71 tok/s decode. linear_flops(B) times each distinct linear shape of the
model at B rows with its weights warm in the cache, so it can only overstate what the kernels do with
weights read from memory.

A bound is an upper bound: a measured decode above it (by more than MAX_FRACTION, for timing noise) means
the bound is wrong, and fraction_of_bound raises RooflineError instead of printing a ratio.

The read bandwidth is the best of torch's `sum` and our own streaming read loop (csrc/stream_read.cpp,
AVX-512 where the CPU has it) on all threads (on this project's machines `sum` sometimes reads ~25% less
than our own GEMV streams, which would understate the bound), over two buffers: --buffer-mib (1 GiB) and
one the size of a decode step's weights, whichever reads faster (a step re-reads the same bytes each token
and may profit from the last-level cache; the bound must not leave that out). The host's bandwidth also
drifts by minutes (42-74 GB/s over one afternoon here, and single runs that stall for a second per token),
so the engine is measured in --rounds rounds, each a bandwidth measurement followed by three engine runs
(their median); the fraction reported is the median of the per-round fractions.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from tokenmill import native
from tokenmill.bench.common import best_seconds, environment, format_table, set_threads, write_json
from tokenmill.config import ModelArchConfig

MAX_FRACTION = 1.05
"""The largest measured / bound ratio taken as timing noise; above it the bound is wrong (RooflineError)."""

BATCHES = (1, 4, 16, 64)
"""Batch sizes of the bound table (--batches)."""


class RooflineError(ValueError):
    """A measured decode rate above its bound: the bound, not the engine, is wrong."""


def _read_kernel():
    """The streaming read of csrc/stream_read.cpp, or None without the C++ kernels."""
    ops = native.ops()
    return None if ops is None else ops.stream_read


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Best-of-n GB/s for a streaming read (the better of torch's sum and our read loop) and a copy (read +
    write counted) of num_bytes."""
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


def _linears(model: torch.nn.Module) -> list:
    from tokenmill.layers.linear import Linear

    return [m for m in model.modules() if isinstance(m, Linear)]


def flops_per_token(model: torch.nn.Module, arch: ModelArchConfig) -> int:
    """Matmul FLOPs of one token's forward: 2 x (every linear's in x out, plus the tied head's vocab x hidden).
    Attention and the elementwise ops are left out, which can only raise the compute bound."""
    weights = sum(m.in_features * m.out_features for m in _linears(model))
    if arch.tie_word_embeddings:  # the embedding table is the head; an untied head is one of the linears
        weights += arch.vocab_size * arch.hidden_size
    return 2 * weights


def measure_linear_flops(model: torch.nn.Module, dtype: torch.dtype, rows: int, repeats: int = 5) -> float:
    """FLOP/s of the engine's own linear kernels at `rows` rows: the first Linear of each distinct (shape,
    method) in the model, called as decode calls it (`Linear.forward`, the layer's quant method and its
    kernel rule) on [rows, in_features] activations, best of `repeats` timings of 8 calls each. The weights
    stay warm in the cache between calls, so the rate is at least what the kernels reach on weights read
    from memory: a compute roof, not a prediction. Each call pays the module path's Python dispatch (a few
    microseconds), which the C++ layer loop does not: where a linear takes only microseconds (the tiny test
    models) the figure understates the loop's rate, so read batch bounds of such models as rough."""
    distinct: dict[tuple, torch.nn.Module] = {}
    for lin in _linears(model):
        distinct.setdefault((lin.in_features, lin.out_features, type(lin.quant_method).__name__), lin)
    flops = seconds = 0.0
    with torch.inference_mode():
        for lin in distinct.values():
            x = torch.randn(rows, lin.in_features).to(dtype)  # [rows, in_features]

            def calls(lin=lin, x=x) -> None:
                for _ in range(8):
                    lin(x)

            seconds += best_seconds(calls, repeats)
            flops += 8 * 2 * rows * lin.in_features * lin.out_features
    return flops / seconds if seconds > 0 else 0.0


@dataclass(frozen=True)
class DecodeBound:
    """Upper bound on decode tok/s for a batch, and which roof sets it."""

    tok_s: float
    """The bound: the lower of the memory and (where it applies) the compute bound."""
    memory_tok_s: float
    """batch x read bandwidth / bytes of one step (weights once + every sequence's K/V)."""
    compute_tok_s: float | None
    """The engine's linear FLOP/s at this batch / FLOPs per token; None at batch 1 or when not measured."""
    binding: str
    """"memory" or "compute"."""


def decode_bound(
    bw_bytes_s: float,
    weight_bytes: int,
    kv_bytes_per_token: float,
    batch: int,
    context: int,
    flops_per_token: float = 0.0,
    linear_flops_s: float | None = None,
) -> DecodeBound:
    """Upper bound on decode tok/s for `batch` sequences of `context` tokens each (see the module docstring).
    The compute bound counts only for batch > 1 with a measured linear_flops_s of the engine's kernels.

    Worked example (the AVX2 host of issue 47): bf16 SmolLM2-135M reads 269.1 MB of weights and 96 x 23,040
    bytes of K/V per step; at 32.7 GB/s that is 32.7e9 / 271.2e6 = 120.6 tok/s. A compute rate measured at
    ~0 (torch's bf16 matmul there) does not enter at batch 1, so the bound is 120.6 tok/s, memory-bound,
    and a 71 tok/s decode is at 0.59 of it."""
    if bw_bytes_s <= 0:
        raise ValueError(f"read bandwidth must be > 0, got {bw_bytes_s}")
    step_bytes = weight_bytes + batch * context * kv_bytes_per_token
    memory = batch * bw_bytes_s / step_bytes
    compute = None
    if batch > 1 and linear_flops_s is not None and flops_per_token > 0:
        if linear_flops_s <= 0:
            raise ValueError(f"linear FLOP/s must be > 0 where it bounds (batch {batch}), got {linear_flops_s}")
        compute = linear_flops_s / flops_per_token
    if compute is not None and compute < memory:
        return DecodeBound(compute, memory, compute, "compute")
    return DecodeBound(memory, memory, compute, "memory")


def fraction_of_bound(measured_tok_s: float, bound_tok_s: float, max_fraction: float = MAX_FRACTION) -> float:
    """measured / bound, which an upper bound keeps at or below 1; above max_fraction (timing noise allowed)
    the bound is wrong and this raises RooflineError rather than report a figure."""
    fraction = measured_tok_s / bound_tok_s
    if fraction > max_fraction:
        raise RooflineError(
            f"measured decode {measured_tok_s:.1f} tok/s is {fraction:.2f}x the roofline bound of "
            f"{bound_tok_s:.1f} tok/s (more than {max_fraction}x): the bound is wrong (bandwidth measured "
            "too low, or bytes per step counted too high), so no fraction is reported"
        )
    return fraction


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
        if "gguf_blocks" in name and "embed_tokens" in name:  # a GGUF token table (quant/gguf.py)
            embed += b.numel() * b.element_size()
        elif any(k in name for k in ("qweight", "scales", "qzeros", "weight_packed", "scale", "gguf_blocks")):
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
    g.add_argument(
        "--batches",
        default=",".join(map(str, BATCHES)),
        help=f"Batch sizes of the bound table, comma list; the linears are timed at each above 1 "
        f"(default: {','.join(map(str, BATCHES))})",
    )
    g.add_argument("--output-json", default=None)


def _bound_dict(b: DecodeBound) -> dict:
    return {
        "tok_s": b.tok_s,
        "memory_tok_s": b.memory_tok_s,
        "compute_tok_s": b.compute_tok_s,
        "binding": b.binding,
    }


def run_roofline(args: argparse.Namespace) -> dict:
    """Measure and compute the bounds; with the engine measured, raises RooflineError when a round's decode
    is above its bound (fraction_of_bound)."""
    from tokenmill import LLM
    from tokenmill.bench.engine_runs import engine_kwargs, engine_timed_generate, make_prompt_ids, warm_up
    from tokenmill.bench.latency import measure

    threads = set_threads(args.num_threads)
    llm = LLM(**engine_kwargs(args))
    eng = llm.engine
    dtype = eng.config.model.torch_dtype
    elem = torch.empty((), dtype=eng.kv_spec.dtype).element_size()
    mb = model_bytes(eng.model, eng.arch, elem)
    mb["flops_per_token"] = flops_per_token(eng.model, eng.arch)
    step_bytes = mb["weight_bytes_per_step"]
    # The engine's linear kernels at each batch of the table above 1 (batch 1 is bandwidth bound).
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    linear = {b: measure_linear_flops(eng.model, dtype, b) for b in batches if b > 1}

    def bandwidth() -> dict:
        # The bound's bandwidth is the better of a --buffer-mib read and a read of a buffer the size of
        # one decode step's weights: the step re-reads the same bytes every token, and a buffer of that
        # size profits from the last-level cache as the engine does (here a 270 MiB buffer read ~5%
        # faster than 1 GiB, a 64 MiB one ~55% faster).
        big = measure_bandwidth(args.buffer_mib << 20)
        step = measure_bandwidth(max(step_bytes, 1 << 20) // 64 * 64)
        best = big if big["read_gb_s"] >= step["read_gb_s"] else step
        return {**best, "read_big_buffer_gb_s": big["read_gb_s"], "read_step_size_gb_s": step["read_gb_s"]}

    def bound(read_gb_s: float, batch: int, context: int) -> DecodeBound:
        return decode_bound(
            read_gb_s * 1e9,
            mb["weight_bytes_per_step"],
            mb["kv_bytes_per_token"],
            batch,
            context,
            mb["flops_per_token"],
            linear.get(batch),
        )

    bw = bandwidth()
    ctx = args.input_len + args.output_len // 2  # mean context over the measured run
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
        "linear_tflop_s": {f"B={b}": v / 1e12 for b, v in linear.items()},
        "model": mb,
        "single_stream_bound_tok_s": bound(bw["read_gb_s"], 1, ctx).tok_s,
        "batch_bounds": {f"B={b},ctx=512": _bound_dict(bound(bw["read_gb_s"], b, 512)) for b in batches},
    }
    if not args.no_measure_engine:
        import statistics

        warm_up(llm)
        prompt = make_prompt_ids(llm.tokenizer, args.input_len)
        rounds = []
        for _ in range(max(1, args.rounds)):
            bw_r = bandwidth()
            bound_r = bound(bw_r["read_gb_s"], 1, ctx).tok_s
            m, _ = measure(lambda ids, n: engine_timed_generate(eng, ids, n), prompt, args.output_len, 3)
            rounds.append(
                {
                    "read_gb_s": bw_r["read_gb_s"],
                    "bound_tok_s": bound_r,
                    "measured_decode_tok_s": m["decode_tok_s"],
                    "fraction": fraction_of_bound(m["decode_tok_s"], bound_r),
                }
            )
        res["rounds"] = rounds
        mid = sorted(rounds, key=lambda r: r["fraction"])[len(rounds) // 2]
        res["measured_decode_tok_s"] = mid["measured_decode_tok_s"]
        res["round_bound_tok_s"] = mid["bound_tok_s"]
        res["fraction_of_bound"] = statistics.median(r["fraction"] for r in rounds)
    return res


def print_roofline(res: dict) -> None:
    bw, mb = res["bandwidth"], res["model"]
    linear = ", ".join(f"{k} {v:.3f}" for k, v in res["linear_tflop_s"].items())
    print(
        f"\nmemory: read {bw['read_gb_s']:.1f} GB/s "
        f"(best of a {bw['read_big_buffer_gb_s']:.1f} GB/s big-buffer read and "
        f"{bw['read_step_size_gb_s']:.1f} GB/s over a buffer of one step's bytes; "
        f"torch sum {bw['read_sum_gb_s']:.1f}), "
        f"copy {bw['copy_gb_s']:.1f} GB/s ({bw['buffer_mib']} MiB buffer); "
        f"the engine's linears ({res['config']['dtype']}, weights in cache): {linear} TFLOP/s "
        f"({res['config']['threads']} threads)"
    )
    print(
        f"model: {mb['num_params'] / 1e6:.1f} M params, {mb['weight_bytes_per_step'] / 2**20:.1f} MiB read per "
        f"decode step ({res['config']['dtype']}), KV {mb['kv_bytes_per_token'] / 1024:.1f} KiB/token, "
        f"{mb['flops_per_token'] / 1e6:.0f} MFLOP per token"
    )
    rows: list[list] = [["single stream (bound, memory)", res["single_stream_bound_tok_s"]]]
    for k, b in res["batch_bounds"].items():
        compute = "left out (bandwidth bound)" if b["compute_tok_s"] is None else f"{b['compute_tok_s']:.1f}"
        rows.append([f"bound {k}: {b['binding']} (memory {b['memory_tok_s']:.1f}, compute {compute})", b["tok_s"]])
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
