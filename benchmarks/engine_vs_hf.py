"""Issue 2's benchmark: tokenmill vs Hugging Face transformers `generate`, same model, dtype and
thread count, in one process, reported as ratios.

  1. single-stream decode tok/s: batch 1, 128 new tokens (EOS ignored), runs interleaved
     (ours, HF, ours, HF, ...) so machine noise hits both alike; the median run of each is kept;
  2. offline throughput: 64 ShareGPT prompts (vLLM's filter, reply lengths as output lengths),
     output tok/s; tokenmill with continuous batching, HF with static batches (vLLM's run_hf).

Targets: single stream >= 1.5x HF, throughput >= 3x HF.

    python benchmarks/engine_vs_hf.py --num-threads 2 [--dtype bfloat16|float32] \
        [--output-json bench_out/engine_vs_hf.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

TARGET_SINGLE, TARGET_THROUGHPUT = 1.5, 3.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default: the fast path on this CPU), float32, auto")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="Interleaved single-stream runs per engine")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--dataset", default=None, help="ShareGPT file (default: ../shared/data next to the repo)")
    p.add_argument("--max-output-len", type=int, default=None, help="Cap ShareGPT reply lengths (default: none)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="HF static batch size (default: 64)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--skip", choices=["single", "throughput"], default=None)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)

    from tokenmill import LLM
    from tokenmill.bench.common import environment, format_table, load_sharegpt, set_threads, write_json
    from tokenmill.bench.engine_runs import (
        common_prefix_len,
        engine_throughput,
        engine_timed_generate,
        make_prompt_ids,
        warm_up,
    )
    from tokenmill.bench.peers import HFPeer

    threads = set_threads(args.num_threads)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=1 << 30,
    )
    dtype = llm.engine.config.model.torch_dtype
    warm_up(llm)
    t = time.perf_counter()
    hf = HFPeer(args.model, dtype)
    hf_load_s = time.perf_counter() - t
    res: dict = {
        "config": {**vars(args), "dtype": str(dtype).removeprefix("torch."), "threads": threads},
        "env": environment(threads),
        "hf_load_s": hf_load_s,
    }
    rows = []
    if args.skip != "single":
        prompt = make_prompt_ids(llm.tokenizer, args.input_len)
        engine_timed_generate(llm.engine, prompt, 8)
        hf.timed_generate(prompt, 8)
        ours_runs, hf_runs = [], []
        for _ in range(args.repeats):
            timing, our_toks = engine_timed_generate(llm.engine, prompt, args.output_len)
            ours_runs.append(timing.summary())
            timing, hf_toks = hf.timed_generate(prompt, args.output_len)
            hf_runs.append(timing.summary())
        o = statistics.median(r["decode_tok_s"] for r in ours_runs)
        h = statistics.median(r["decode_tok_s"] for r in hf_runs)
        res["single_stream"] = {
            "tokenmill_decode_tok_s": o,
            "hf_decode_tok_s": h,
            "ratio": o / h,
            "tokenmill_runs": [r["decode_tok_s"] for r in ours_runs],
            "hf_runs": [r["decode_tok_s"] for r in hf_runs],
            "tokenmill_ttft_ms": statistics.median(r["ttft_ms"] for r in ours_runs),
            "hf_ttft_ms": statistics.median(r["ttft_ms"] for r in hf_runs),
            "greedy_prefix_match": common_prefix_len(our_toks, hf_toks),
            "target": TARGET_SINGLE,
            "meets_target": o / h >= TARGET_SINGLE,
        }
        rows.append([f"single-stream decode tok/s (batch 1, {args.output_len} new)", o, h, o / h, TARGET_SINGLE])
        print(f"single stream: tokenmill {o:.1f} tok/s, HF {h:.1f} tok/s, {o / h:.2f}x", flush=True)
    if args.skip != "throughput":
        requests = load_sharegpt(args.dataset, llm.tokenizer, args.num_prompts, 0, None, args.max_output_len)
        ours = engine_throughput(llm, requests)
        print(f"throughput: tokenmill {ours['output_tok_s']:.1f} out tok/s ({ours['elapsed_s']:.1f} s)", flush=True)
        theirs = hf.throughput(requests, args.hf_batch_size)
        print(f"throughput: HF {theirs['output_tok_s']:.1f} out tok/s ({theirs['elapsed_s']:.1f} s)", flush=True)
        ratio = ours["output_tok_s"] / theirs["output_tok_s"]
        res["throughput"] = {
            "tokenmill": ours,
            "hf": theirs,
            "ratio": ratio,
            "target": TARGET_THROUGHPUT,
            "meets_target": ratio >= TARGET_THROUGHPUT,
        }
        rows.append(
            [
                f"offline output tok/s ({len(requests)} ShareGPT prompts, {ours['output_tokens']} out tokens)",
                ours["output_tok_s"],
                theirs["output_tok_s"],
                ratio,
                TARGET_THROUGHPUT,
            ]
        )
    print(f"\n{args.model}, {res['config']['dtype']}, {threads} threads, loadavg {res['env']['loadavg']}")
    print(format_table(["measure", "tokenmill", "HF transformers", "ratio", "target"], rows))
    write_json(args.output_json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
