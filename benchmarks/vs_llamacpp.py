"""Single-stream decode, tokenmill vs llama.cpp (llama-cpp-python), one process, same thread count,
runs interleaved (ours, theirs, ours, ...) so machine noise hits both; the median run is kept.

Precision classes compared: our bf16 weights, our int8 (per channel) and int4 (g64) weight-only
checkpoints against llama.cpp on the model's published Q4_1 GGUF (the only GGUF shipped offline;
llama.cpp F16/Q8_0 files of this model are not available here, so only int4 vs Q4_1 is a
same-class ratio).

    tokenmill quantize --method rtn --bits 4 --group-size 64 --out /tmp/smollm2-int4
    python benchmarks/vs_llamacpp.py --num-threads 2 --int4-model /tmp/smollm2-int4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--int4-model", default=None, help="our int4 checkpoint dir (tokenmill quantize ...)")
    ap.add_argument("--int8-model", default=None, help="our int8 checkpoint dir")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    os.environ["TOKENMILL_NUM_THREADS"] = str(args.num_threads)
    import torch
    torch.set_num_threads(args.num_threads)
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.peers import LlamaCppPeer, llamacpp_available

    reason = llamacpp_available()
    if reason:
        print(f"llama.cpp: absent ({reason})")
        return 1
    theirs = LlamaCppPeer("smollm2-135m", args.num_threads)
    ours = {"bf16": LLM("smollm2-135m", dtype="bfloat16", kv_cache_memory_bytes=64 << 20)}
    if args.int8_model:
        ours["int8"] = LLM(args.int8_model, dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    if args.int4_model:
        ours["int4"] = LLM(args.int4_model, dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    prompt = ours["bf16"].tokenizer.encode("Write a short story about a lighthouse keeper who finds a message in a bottle.")
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)

    def ours_tok_s(llm) -> float:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return 1.0 / out.metrics.time_per_output_token

    def theirs_tok_s() -> float:
        timing, toks = theirs.timed_generate(prompt, args.new_tokens)
        t = timing.token_times
        return (len(t) - 1) / (t[-1] - t[0])

    runs: dict[str, list[float]] = {k: [] for k in [*ours, "llama.cpp Q4_1"]}
    for name, llm in ours.items():  # warm-up (kernel choice, caches)
        ours_tok_s(llm)
    theirs_tok_s()
    for _ in range(args.repeats):
        for name, llm in ours.items():
            runs[name].append(ours_tok_s(llm))
        runs["llama.cpp Q4_1"].append(theirs_tok_s())
    med = {k: statistics.median(v) for k, v in runs.items()}
    ref = med["llama.cpp Q4_1"]
    print(f"single-stream decode, {args.new_tokens} new tokens, {args.num_threads} threads, "
          f"loadavg {os.getloadavg()[0]:.2f}, median of {args.repeats} interleaved runs")
    print("| engine | decode tok/s | vs llama.cpp Q4_1 |")
    print("|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.1f} | {v / ref:.2f}x |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"runs": runs, "median": med, "loadavg": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
