"""Perplexity with the protocol of the GPTQ and AWQ papers' code:

    text   = "\n\n".join(rows)                      (WikiText-2 raw test, 4,358 rows)
    ids    = tokenize(text), once, no BOS added
    windows: ids[i*L : (i+1)*L] for i < len(ids) // L   (non-overlapping, L = min(2048, context); tail dropped)
    each window scored on its own from position 0; NLL of tokens 1..L-1 given their prefix
    ppl    = exp(mean NLL over all predicted tokens)

Every window predicts L - 1 tokens, so this equals the reference's exp(mean of window means).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from tokenmill.quant.calibration import default_data_dir, read_jsonl_texts

WIKITEXT2_FILE = "wikitext2_raw_test.jsonl"


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    num_windows: int
    """Windows scored (may be fewer than available, see total_windows)."""
    total_windows: int
    seqlen: int
    num_tokens: int
    """Tokens in the whole tokenized text."""
    seconds: float


def wikitext2_ids(encode, path: str | Path | None = None) -> torch.Tensor:
    """The test split joined with blank lines, tokenized once without BOS -> [num_tokens] int64."""
    path = Path(path) if path else default_data_dir() / WIKITEXT2_FILE
    text = "\n\n".join(read_jsonl_texts(path))
    return torch.tensor(encode(text), dtype=torch.int64)


def make_windows(ids: torch.Tensor, seqlen: int) -> torch.Tensor:
    """ids [N] -> [N // seqlen, seqlen] (tail dropped)."""
    n = ids.numel() // seqlen
    if n == 0:
        raise ValueError(f"text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    return ids[: n * seqlen].reshape(n, seqlen)


def window_nll(model: nn.Module, window: torch.Tensor, chunk: int = 512) -> float:
    """Sum of NLL of tokens 1..T-1 of window [T] (logits computed `chunk` rows at a time)."""
    t = window.numel()
    with torch.no_grad():
        h = model(window, torch.arange(t))  # [T, hidden]
        total = 0.0
        for s in range(0, t - 1, chunk):
            e = min(s + chunk, t - 1)
            logits = model.compute_logits(h[s:e])  # [n, vocab] float32
            total += float(F.cross_entropy(logits, window[s + 1 : e + 1], reduction="sum"))
    return total


def evaluate_perplexity(
    model: nn.Module, ids: torch.Tensor, seqlen: int = 2048, max_windows: int | None = None, progress: bool = True
) -> PerplexityResult:
    windows = make_windows(ids, seqlen)
    total = windows.shape[0]
    n = total if max_windows is None else min(max_windows, total)
    t0 = time.perf_counter()
    nll = 0.0
    for i in tqdm(range(n), desc="perplexity", disable=not progress, unit="window"):
        nll += window_nll(model, windows[i])
    mean = nll / (n * (seqlen - 1))
    return PerplexityResult(
        perplexity=math.exp(mean),
        mean_nll=mean,
        num_windows=n,
        total_windows=total,
        seqlen=seqlen,
        num_tokens=ids.numel(),
        seconds=time.perf_counter() - t0,
    )
