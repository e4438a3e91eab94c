"""Single-stream decode, tokenmill vs llama.cpp (llama-cpp-python), one process, same thread count,
runs interleaved (ours, theirs, ours, ...) so machine noise hits both; the median run is kept.

Precision classes, each ratio against llama.cpp at the same class: our bf16 weights vs an F16
GGUF, our int8 (per channel) checkpoint vs Q8_0, our int4 (g64) checkpoint vs the published Q4_1.
Only the Q4_1 file ships offline; --make-ggufs DIR writes the F16 and Q8_0 files from it with
llama.cpp's own `llama-quantize --allow-requantize` (built beside llama-server by
scripts/build_llama_server.sh, or $TOKENMILL_LLAMA_QUANTIZE), so all three hold the same weights.

    tokenmill quantize --method rtn --bits 4 --group-size 64 --out /tmp/smollm2-int4
    tokenmill quantize --method rtn --bits 8 --out /tmp/smollm2-int8
    python benchmarks/vs_llamacpp.py --num-threads 2 --int4-model /tmp/smollm2-int4 \
        --int8-model /tmp/smollm2-int8 --make-ggufs /tmp/smollm2-gguf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def find_llama_quantize() -> Path | None:
    """$TOKENMILL_LLAMA_QUANTIZE, else llama-quantize beside the llama-server the benchmarks use."""
    from tokenmill.bench.peers import DEFAULT_LLAMA_SERVER, find_llama_server

    env = os.environ.get("TOKENMILL_LLAMA_QUANTIZE")
    if env:
        return Path(env) if Path(env).is_file() else None
    server = find_llama_server() or DEFAULT_LLAMA_SERVER
    p = Path(server).with_name("llama-quantize")
    return p if p.is_file() else None


def make_ggufs(out_dir: Path, source: Path) -> dict[str, Path]:
    """F16 and Q8_0 GGUFs of `source` (requantized by llama.cpp), written once into out_dir."""
    tool = find_llama_quantize()
    if tool is None:
        raise SystemExit(
            "--make-ggufs: llama-quantize not found (scripts/build_llama_server.sh builds it, "
            "or set $TOKENMILL_LLAMA_QUANTIZE)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    env = dict(os.environ, LD_LIBRARY_PATH=str(tool.parent))
    for kind in ("F16", "Q8_0"):
        dst = out_dir / f"{source.stem.split('.')[0]}-{kind}.gguf"
        if not dst.exists():
            subprocess.run(
                [str(tool), "--allow-requantize", str(source), str(dst), kind],
                env=env,
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        files[kind] = dst
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--int4-model", default=None, help="our int4 checkpoint dir (tokenmill quantize ...)")
    ap.add_argument("--int8-model", default=None, help="our int8 checkpoint dir")
    ap.add_argument(
        "--make-ggufs",
        default=None,
        metavar="DIR",
        help="write F16 and Q8_0 GGUFs of the model into DIR with llama-quantize and compare the "
        "same precision classes (bf16 vs F16, int8 vs Q8_0)",
    )
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
    from tokenmill.models.loader import resolve_model_path

    theirs = {"Q4_1": LlamaCppPeer("smollm2-135m", args.num_threads)}
    if args.make_ggufs:
        for kind, path in make_ggufs(Path(args.make_ggufs), Path(resolve_model_path("smollm2-135m"))).items():
            theirs[kind] = LlamaCppPeer(str(path), args.num_threads)
    same_class = {"bf16": "F16", "int8": "Q8_0", "int4": "Q4_1"}
    ours = {"bf16": LLM("smollm2-135m", dtype="bfloat16", kv_cache_memory_bytes=64 << 20)}
    if args.int8_model:
        ours["int8"] = LLM(args.int8_model, dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    if args.int4_model:
        ours["int4"] = LLM(args.int4_model, dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    prompt = ours["bf16"].tokenizer.encode(
        "Write a short story about a lighthouse keeper who finds a message in a bottle."
    )
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)

    def ours_tok_s(llm) -> float:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return 1.0 / out.metrics.time_per_output_token

    def theirs_tok_s(peer) -> float:
        timing, toks = peer.timed_generate(prompt, args.new_tokens)
        t = timing.token_times
        return (len(t) - 1) / (t[-1] - t[0])

    runs: dict[str, list[float]] = {k: [] for k in [*ours, *(f"llama.cpp {t}" for t in theirs)]}
    for llm in ours.values():  # warm-up (kernel choice, caches)
        ours_tok_s(llm)
    for peer in theirs.values():
        theirs_tok_s(peer)
    for _ in range(args.repeats):
        for name, llm in ours.items():
            runs[name].append(ours_tok_s(llm))
        for kind, peer in theirs.items():
            runs[f"llama.cpp {kind}"].append(theirs_tok_s(peer))
    med = {k: statistics.median(v) for k, v in runs.items()}
    ref = med["llama.cpp Q4_1"]
    print(
        f"single-stream decode, {args.new_tokens} new tokens, {args.num_threads} threads, "
        f"loadavg {os.getloadavg()[0]:.2f}, median of {args.repeats} interleaved runs"
    )
    print("| engine | decode tok/s | vs llama.cpp Q4_1 | vs llama.cpp, same precision class |")
    print("|---|---|---|---|")
    for k, v in med.items():
        peer = f"llama.cpp {same_class.get(k, '')}"
        same = f"{v / med[peer]:.2f}x ({peer})" if peer in med else ""
        print(f"| {k} | {v:.1f} | {v / ref:.2f}x | {same} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"runs": runs, "median": med, "loadavg": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
