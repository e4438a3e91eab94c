"""CUDA check, run by benchmarks/cuda_check.sh on a GPU machine: greedy output on CUDA vs CPU
(fp32 must match token for token on most prompts; bf16 is reported), then a single-stream decode
figure and a batch-64 offline throughput figure on CUDA. Writes everything to $OUT/cuda.json,
including any error with its traceback (a partial result is still a result)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

OUT = Path(os.environ.get("OUT", "bench_out")) / "cuda.json"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "List three uses of copper:",
    "The quick brown fox",
    "In machine learning, overfitting means",
]
res: dict = {"ok": False, "stages": {}}


def save() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2, default=str))


def stage(name):
    def deco(fn):
        def run(*a):
            t = time.perf_counter()
            try:
                out = fn(*a)
                res["stages"][name] = {"ok": True, "seconds": round(time.perf_counter() - t, 1), **(out or {})}
            except Exception as e:
                res["stages"][name] = {
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(limit=8),
                }
            save()
            print(name, json.dumps(res["stages"][name], default=str)[:600], flush=True)

        return run

    return deco


def greedy(llm, n=32):
    from tokenmill import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    import torch

    res["env"] = {
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
    }
    save()
    if not torch.cuda.is_available():
        res["error"] = "torch.cuda.is_available() is False"
        save()
        return 1
    from tokenmill import LLM

    state: dict = {}

    @stage("cpu_reference_fp32")
    def cpu_ref():
        llm = LLM(model="smollm2-135m", dtype="float32", device="cpu", kv_cache_memory_bytes=256 << 20)
        state["cpu"] = greedy(llm)
        return {"num_prompts": len(PROMPTS)}

    @stage("cuda_correctness")
    def cuda_correct():
        out = {}
        for dt in ("float32", "bfloat16"):
            llm = LLM(model="smollm2-135m", dtype=dt, device="cuda", kv_cache_memory_bytes=1 << 30)
            toks = greedy(llm)
            m = [prefix(a, b) for a, b in zip(toks, state["cpu"])]
            out[dt] = {"identical_prompts": sum(x == 32 for x in m), "of": len(m), "matching_prefix_tokens": m}
            del llm
            torch.cuda.empty_cache()
        out["fp32_matches_cpu"] = out["float32"]["identical_prompts"] >= len(PROMPTS) - 1
        return out

    @stage("cuda_perf_bf16")
    def cuda_perf():
        from tokenmill.bench.common import load_sharegpt, random_requests
        from tokenmill.bench.engine_runs import engine_throughput, engine_timed_generate, make_prompt_ids, warm_up

        llm = LLM(
            model="smollm2-135m",
            dtype="bfloat16",
            device="cuda",
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            kv_cache_memory_bytes=4 << 30,
        )
        warm_up(llm)
        prompt = make_prompt_ids(llm.tokenizer, 32)
        engine_timed_generate(llm.engine, prompt, 8)
        runs = [engine_timed_generate(llm.engine, prompt, 128)[0].summary()["decode_tok_s"] for _ in range(3)]
        try:
            reqs, data = load_sharegpt(None, llm.tokenizer, 64), "sharegpt"
        except ValueError:
            reqs, data = random_requests(llm.tokenizer, 64, 256, 256, 0.5), "random 256+-50% in / out"
        tp = engine_throughput(llm, reqs)
        return {"single_stream_decode_tok_s": sorted(runs)[1], "runs": runs, "batch64_dataset": data, "batch64": tp}

    cpu_ref()
    if "cpu" in state:
        cuda_correct()
    cuda_perf()
    res["ok"] = all(s.get("ok") for s in res["stages"].values())
    save()
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        save()
        raise
