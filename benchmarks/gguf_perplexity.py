"""WikiText-2 perplexity of one GGUF file three ways, on the same token windows: tokenmill running the file's
blocks (the default), tokenmill with the file dequantized at load (--gguf-dequantize, float32: the weights'
exact values), and llama.cpp (llama-cpp-python, logits of every position).

The windows are tokenmill/eval/perplexity.py's (WikiText-2 test joined with blank lines, tokenized once,
non-overlapping windows of --seqlen, each scored from position 0); llama.cpp is fed the same token ids.

    python benchmarks/gguf_perplexity.py --model smollm2-135m --seqlen 512 --windows 8
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch


def llamacpp_nll(path: str, windows: torch.Tensor, threads: int) -> float:
    import llama_cpp

    seqlen = windows.shape[1]
    llm = llama_cpp.Llama(
        model_path=path, n_ctx=seqlen, n_batch=seqlen, logits_all=True, n_threads=threads, verbose=False
    )
    total = 0.0
    for w in windows.tolist():
        llm.reset()
        llm.eval(w)
        logits = np.asarray(llm.scores[: seqlen - 1], dtype=np.float64)
        m = logits.max(axis=1, keepdims=True)
        logz = (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]
        total += float((logz - logits[np.arange(seqlen - 1), w[1:]]).sum())
    return total


def main() -> None:
    from tokenmill.eval.perplexity import make_windows, wikitext2_ids, window_nll
    from tokenmill.models.loader import load_model, resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model_path(args.model))
    native = load_model(path, dtype=torch.float32)
    windows = make_windows(wikitext2_ids(native.tokenizer.encode), args.seqlen)[: args.windows]
    n_pred = windows.shape[0] * (args.seqlen - 1)
    result = {}
    result["tokenmill_native"] = math.exp(sum(window_nll(native.model, w) for w in windows) / n_pred)
    del native
    dense = load_model(path, dtype=torch.float32, gguf_dequantize=True, load_tokenizer=False)
    result["tokenmill_dequantized"] = math.exp(sum(window_nll(dense.model, w) for w in windows) / n_pred)
    del dense
    result["llamacpp"] = math.exp(llamacpp_nll(path, windows, args.threads) / n_pred)
    result["native_vs_llamacpp"] = result["tokenmill_native"] / result["llamacpp"] - 1
    print(json.dumps({"model": args.model, "seqlen": args.seqlen, "windows": int(windows.shape[0]), **result}))


if __name__ == "__main__":
    main()
