"""The same GGUF file in tokenmill (default flags: blocks kept as the file holds them) and llama.cpp
(llama-cpp-python), single stream, and the memory each holds for the weights.

Files: the shipped SmolLM2-135M Q4_1, a Q8_0 of it written by llama.cpp's own quantizer
(`llama_model_quantize` through llama-cpp-python, --allow-requantize), and Gemma 3 270M Q4_K_M. Speed is
`tokenmill bench latency --peers llamacpp` per file (each engine in its own runs, interleaved, median of
--num-iters). Memory, each in a fresh process: tokenmill's weights as loaded (every parameter and buffer of
the model but the RoPE cos/sin tables; KV pool excluded) and the process's RSS growth over loading;
llama.cpp's RSS growth over `Llama(model)` with a 512-token context.

    python benchmarks/gguf_native.py --num-threads 2 --out /tmp/gguf_native.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MEMORY_PROBE = r"""
import json, os, sys
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
engine, path = sys.argv[1], sys.argv[2]
if engine == "tokenmill":
    import torch
    from tokenmill.models.loader import load_model
    before = rss()
    loaded = load_model(path, dtype=torch.float32, load_tokenizer=False)
    tensors = list(loaded.model.named_parameters()) + list(loaded.model.named_buffers())
    weights = sum(t.numel() * t.element_size() for n, t in tensors if "cos_sin" not in n)  # not the RoPE tables
    print(json.dumps({"weights_bytes": weights, "rss_growth": rss() - before}))
else:
    import llama_cpp
    before = rss()
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=1, verbose=False)
    print(json.dumps({"rss_growth": rss() - before}))
"""


def make_q8_0(source: Path, out: Path) -> Path:
    """A Q8_0 GGUF of `source`, written by llama.cpp's own quantizer."""
    if out.exists():
        return out
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source} to Q8_0")
    return out


def memory(engine: str, path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, engine, str(path)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def latency(path: Path, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [
            *(sys.executable, "-m", "tokenmill", "bench", "latency", "--model", str(path), "--dtype", args.dtype),
            *("--num-threads", str(args.num_threads), "--input-len", "32", "--output-len", str(args.output_len)),
            *("--num-iters", str(args.num_iters), "--peers", "llamacpp", "--output-json", f.name),
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(f.name).read_text())


def main() -> None:
    from tokenmill.models.loader import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="tokenmill's --dtype (its default: auto)")
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "tokenmill-gguf")
    ap.add_argument("--only", default="", help="comma-separated file labels (q4_1, q8_0, gemma3_q4_k_m)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    q4_1 = resolve_model_path("smollm2-135m")
    files = {
        "q4_1": ("SmolLM2-135M Q4_1", q4_1),
        "q8_0": ("SmolLM2-135M Q8_0 (llama.cpp requant)", None),
        "gemma3_q4_k_m": ("Gemma 3 270M Q4_K_M", resolve_model_path("gemma3-270m")),
    }
    wanted = [k for k in files if not args.only or k in args.only.split(",")]
    rows = {}
    for key in wanted:
        label, path = files[key]
        if path is None:
            path = make_q8_0(q4_1, args.work_dir / "SmolLM2-135M-Instruct.Q8_0.gguf")
        lat = latency(path, args)
        ours, theirs = memory("tokenmill", path), memory("llamacpp", path)
        rows[key] = {
            "label": label,
            "file_bytes": path.stat().st_size,
            "tokenmill_tok_s": lat["tokenmill"]["decode_tok_s"],
            "llamacpp_tok_s": lat["llamacpp"]["decode_tok_s"],
            "ratio": lat["ratio_vs_llamacpp"],
            "dtype": lat["config"]["dtype"],
            "tokenmill_weights_bytes": ours["weights_bytes"],
            "tokenmill_rss_growth": ours["rss_growth"],
            "llamacpp_rss_growth": theirs["rss_growth"],
        }
        print(json.dumps({key: rows[key]}), flush=True)
    print(f"\n{args.num_threads} threads, {args.output_len} new tokens after 32, median of {args.num_iters}")
    print("| file | tokenmill tok/s | llama.cpp tok/s | ratio | weights held / file | RSS growth: ours, llama.cpp |")
    print("|---|---|---|---|---|---|")
    for r in rows.values():
        mb = 1e6
        print(
            f"| {r['label']} | {r['tokenmill_tok_s']:.1f} ({r['dtype']}) | {r['llamacpp_tok_s']:.1f} | "
            f"{r['ratio']:.2f}x | {r['tokenmill_weights_bytes'] / mb:.0f} / {r['file_bytes'] / mb:.0f} MB "
            f"({r['tokenmill_weights_bytes'] / r['file_bytes']:.2f}x) | "
            f"{r['tokenmill_rss_growth'] / mb:.0f} MB, {r['llamacpp_rss_growth'] / mb:.0f} MB |"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
