"""Shared pieces of the benchmarks: datasets, percentile summaries, tables and JSON output."""

from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SHAREGPT = REPO_ROOT.parent / "shared" / "data" / "sharegpt_v3_first_exchange_5000.jsonl"
"""../shared/data next to the repository; override with --dataset."""


def first_turns(n: int, min_chars: int, max_chars: int, path: str | Path = DEFAULT_SHAREGPT) -> list[str]:
    """The first n ShareGPT first turns, in file order, whose length lies strictly between min_chars and
    max_chars (the fixed prompt sets of the A/B benchmarks; `load_sharegpt` is vLLM's sampled filter)."""
    rows: list[str] = []
    with open(path) as f:
        for line in f:
            text = json.loads(line)["conversations"][0]["value"]
            if min_chars < len(text) < max_chars:
                rows.append(text)
                if len(rows) >= n:
                    break
    return rows


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_token_ids: list[int]
    output_len: int
    """Output tokens to generate (the reference reply's length for ShareGPT), with EOS ignored."""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def is_valid_sharegpt_pair(
    prompt_len: int, output_len: int, max_prompt_len: int = 1024, max_total_len: int = 2048
) -> bool:
    """vLLM's ShareGPT filter: both sides >= 4 tokens, prompt <= 1024, prompt + reply <= 2048."""
    if prompt_len < 4 or output_len < 4:
        return False
    return prompt_len <= max_prompt_len and prompt_len + output_len <= max_total_len


def load_sharegpt(
    path: str | Path | None,
    tokenizer,
    num_requests: int,
    seed: int = 0,
    fixed_output_len: int | None = None,
    max_output_len: int | None = None,
) -> list[SampleRequest]:
    """The first human/gpt exchange of ShareGPT conversations, shuffled with `seed` and filtered
    the way vLLM's benchmark_serving/benchmark_throughput filter them (is_valid_sharegpt_pair).
    `max_output_len` caps the reply length after filtering (a shorter run; off by default)."""
    path = Path(path) if path else DEFAULT_SHAREGPT
    if not path.exists():
        raise ValueError(
            f"dataset {path} not found; pass --dataset PATH (ShareGPT json/jsonl) or --dataset-name random"
        )
    text = path.read_text()
    if path.suffix == ".jsonl":
        rows = [
            json.loads(line) for line in text.split("\n") if line.strip()
        ]  # NOT splitlines(): U+2028 inside strings
    else:
        rows = json.loads(text)
    pairs = [
        (r["conversations"][0]["value"], r["conversations"][1]["value"])
        for r in rows
        if len(r.get("conversations", [])) >= 2
    ]
    random.Random(seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(out) == num_requests:
            break
        ids = tokenizer.encode(prompt)
        out_len = fixed_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if not is_valid_sharegpt_pair(len(ids), out_len):
            continue
        if max_output_len:
            out_len = min(out_len, max_output_len)
        out.append(SampleRequest(prompt, ids, out_len))
    if len(out) < num_requests:
        raise ValueError(f"only {len(out)} ShareGPT pairs in {path} pass the filter; asked for {num_requests}")
    return out


def random_requests(
    tokenizer,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    vocab_size: int | None = None,
) -> list[SampleRequest]:
    """Random token prompts with lengths uniform in [len * (1 - r), len * (1 + r)] (vLLM's random
    dataset). Token ids avoid the first 256 ids (special and byte tokens)."""
    rng = random.Random(seed)
    vocab = vocab_size or tokenizer.vocab_size
    out = []
    for _ in range(num_requests):
        n_in = max(1, int(rng.uniform(input_len * (1 - range_ratio), input_len * (1 + range_ratio))))
        n_out = max(1, int(rng.uniform(output_len * (1 - range_ratio), output_len * (1 + range_ratio))))
        ids = [rng.randrange(256, vocab) for _ in range(n_in)]
        out.append(SampleRequest(tokenizer.decode(ids), ids, n_out))
    return out


def add_dataset_args(parser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--dataset-name",
        choices=["sharegpt", "random"],
        default="sharegpt",
        help="sharegpt: first exchanges of ShareGPT (vLLM's filter); random: random token prompts",
    )
    g.add_argument(
        "--dataset",
        "--dataset-path",
        dest="dataset",
        default=None,
        help=f"ShareGPT .json/.jsonl (default: {DEFAULT_SHAREGPT.relative_to(REPO_ROOT.parent)} "
        "next to the repository)",
    )
    g.add_argument("--num-prompts", type=int, default=64, help="Number of requests (default: 64)")
    g.add_argument("--input-len", type=int, default=256, help="random: mean prompt tokens (default: 256)")
    g.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="random: mean output tokens (default 128); sharegpt: fixed output length instead of the reply's",
    )
    g.add_argument("--max-output-len", type=int, default=None, help="sharegpt: cap reply lengths (default: no cap)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random: length spread (default: 0)")
    if "--seed" not in parser._option_string_actions:  # engine flags already define --seed
        g.add_argument("--seed", type=int, default=0, help="Shuffle / generation seed (default: 0)")


def requests_from_args(args, tokenizer) -> list[SampleRequest]:
    if args.dataset_name == "random":
        return random_requests(
            tokenizer, args.num_prompts, args.input_len, args.output_len or 128, args.range_ratio, args.seed
        )
    return load_sharegpt(args.dataset, tokenizer, args.num_prompts, args.seed, args.output_len, args.max_output_len)


# ----------------------------------------------------------------- statistics
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(values: Sequence[float], percentiles: Iterable[float] = (50, 90, 99)) -> dict[str, float]:
    """mean, median, std and the given percentiles (nan for an empty list)."""
    vals = list(values)
    if not vals:
        nan = float("nan")
        return {"mean": nan, "median": nan, "std": nan, **{f"p{p:g}": nan for p in percentiles}}
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    return {
        "mean": mean,
        "median": percentile(vals, 50),
        "std": std,
        **{f"p{p:g}": percentile(vals, p) for p in percentiles},
    }


# ------------------------------------------------------------------- output
def medians(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over runs of the same measurement (rounds of an A/B), rounded to 0.1."""
    return {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if math.isnan(v):
                return "-"
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.1f}"
        return str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join([line, sep, *body])


def environment(num_threads: int | None = None) -> dict[str, Any]:
    import torch

    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "num_cpus": os.cpu_count(),
        "torch_threads": num_threads or torch.get_num_threads(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {path}")


def set_threads(num_threads: int | None) -> int:
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
        os.environ["TOKENMILL_NUM_THREADS"] = str(num_threads)
    return torch.get_num_threads()


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """terminate a server a benchmark started, then kill it if it has not exited within `timeout` s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn after one untimed warm-up call (the minimum: robust to
    other processes on shared cores)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_in_tree(tree: Path, code: str, args: Sequence[str], timeout: float = 3000) -> dict[str, Any]:
    """Run `python -c code *args` with `tree` first on the path (a before/after checkout) in a fresh
    process, and return the JSON object its last stdout line holds."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"child failed in {tree}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
