"""Peer engines measured in the same run: Hugging Face transformers and llama.cpp.

Both are optional. `hf_available()` / `llamacpp_available()` say whether they can run here; a
benchmark reports an absent peer as {"available": false, "reason": ...} instead of failing.
llama.cpp is used through the llama-cpp-python package (never installed by us: it compiles for a
long time on small machines).
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmill.bench.common import SampleRequest


def absent(reason: str) -> dict:
    return {"available": False, "reason": reason}


PEERS = ("hf", "llamacpp")


def add_peer_ratios(results: dict, metric: str) -> None:
    """results["ratio_vs_<peer>"] = ours / peer on `metric`, for each peer that ran."""
    for name in PEERS:
        if name in results and results[name].get("available", True):
            results[f"ratio_vs_{name}"] = results["tokenmill"][metric] / results[name][metric]


def engine_rows(results: dict, cells, num_cells: int) -> list[list]:
    """One table row per engine present: cells(result) for those that ran, 'absent' otherwise."""
    rows = []
    for name in ("tokenmill", *PEERS):
        r = results.get(name)
        if r is None:
            continue
        if r.get("available") is False:
            rows.append([name, "absent: " + r["reason"]] + [""] * (num_cells - 1))
        else:
            rows.append([name, *cells(r)])
    return rows


def print_peer_ratios(results: dict, what: str) -> None:
    for name in PEERS:
        if f"ratio_vs_{name}" in results:
            print(f"tokenmill / {name}: {results[f'ratio_vs_{name}']:.2f}x {what}")


def hf_available() -> str | None:
    """None if transformers (+ accelerate) can load our GGUF, else the reason why not."""
    for pkg in ("transformers", "accelerate", "gguf"):
        if importlib.util.find_spec(pkg) is None:
            return f"{pkg} is not installed (pip install 'tokenmill[bench]')"
    return None


def llamacpp_available(model: str = "smollm2-135m") -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install llama-cpp-python; it compiles llama.cpp)"
    from tokenmill.models.loader import resolve_model_path
    if resolve_model_path(model).suffix != ".gguf":
        return f"llama.cpp reads GGUF files only; {model} is not one"
    return None


@dataclass
class StreamTiming:
    """Wall-clock times of one generation: start, then one timestamp per generated token."""

    start: float
    token_times: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        from tokenmill.bench.common import summarize
        n = len(self.token_times)
        ttft = self.token_times[0] - self.start if n else float("nan")
        decode_s = self.token_times[-1] - self.token_times[0] if n > 1 else float("nan")
        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        return {"num_tokens": n, "ttft_ms": ttft * 1e3,
                "decode_tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan"),
                "e2e_ms": (self.token_times[-1] - self.start) * 1e3 if n else float("nan"),
                "itl_ms": {k: v * 1e3 for k, v in summarize(gaps).items()}}


# ------------------------------------------------------------------ HF peer
class HFPeer:
    """transformers `generate` on the same GGUF (dequantized by transformers), same dtype."""

    name = "hf-transformers"

    def __init__(self, model: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tokenmill.models.loader import resolve_model_path
        path = Path(resolve_model_path(model))
        import transformers
        kw = {"dtype": dtype} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": dtype}
        if path.suffix != ".gguf":
            self.model = AutoModelForCausalLM.from_pretrained(path, **kw)
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        else:
            # Dense weights in `dtype`, like ours: newer transformers can keep GGUF blocks packed
            # (and compute in fp32) when a kernel is around; ask for a dequantized model instead.
            if hasattr(transformers, "GgufConfig"):
                kw["quantization_config"] = transformers.GgufConfig(gguf_file=path.name, dequantize=True)
            self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kw)
            self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        assert next(self.model.parameters()).dtype == dtype, "HF peer did not load in the requested dtype"
        self.model.eval()
        self.dtype = dtype
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id

    @torch.inference_mode()
    def timed_generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[StreamTiming, list[int]]:
        """Greedy, batch 1, EOS ignored; one timestamp per generated token."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        timing = StreamTiming(time.perf_counter())

        class Stamp(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                timing.token_times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        ids = torch.tensor([prompt_ids])
        timing.start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                  pad_token_id=self.pad_id, stopping_criteria=StoppingCriteriaList([Stamp()]))
        return timing, out[0, ids.shape[1]:].tolist()

    @torch.inference_mode()
    def throughput(self, requests: list[SampleRequest], max_batch_size: int) -> dict:
        """Static batching as vLLM's benchmark_throughput runs HF: a batch grows while it has fewer
        than max_batch_size requests and max(prompt) + max(output) <= 2048; each batch is left-padded
        and generates max(output) tokens for every row (EOS ignored). Counts requested tokens only."""
        batches: list[list[SampleRequest]] = []
        cur: list[SampleRequest] = []
        for r in requests:
            if cur:
                max_in = max(max(x.prompt_len for x in cur), r.prompt_len)
                max_out = max(max(x.output_len for x in cur), r.output_len)
                if len(cur) >= max_batch_size or max_in + max_out > 2048:
                    batches.append(cur)
                    cur = []
            cur.append(r)
        if cur:
            batches.append(cur)
        t0 = time.perf_counter()
        for batch in batches:
            width = max(r.prompt_len for r in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(batch):
                ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
                mask[i, width - r.prompt_len:] = 1
            n_out = max(r.output_len for r in batch)
            self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n_out,
                                min_new_tokens=n_out, pad_token_id=self.pad_id)
        elapsed = time.perf_counter() - t0
        return throughput_figures(requests, elapsed) | {"num_batches": len(batches), "max_batch_size": max_batch_size}


# ------------------------------------------------------------ llama.cpp peer
class LlamaCppPeer:
    """llama.cpp through llama-cpp-python on the same GGUF file and thread count."""

    name = "llama.cpp"

    def __init__(self, model: str, num_threads: int, n_ctx: int = 2048) -> None:
        from llama_cpp import Llama

        from tokenmill.models.loader import resolve_model_path
        self.path = Path(resolve_model_path(model))
        self.llm = Llama(model_path=str(self.path), n_threads=num_threads, n_threads_batch=num_threads,
                         n_ctx=n_ctx, verbose=False)

    def timed_generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[StreamTiming, list[int]]:
        self.llm.reset()
        timing = StreamTiming(time.perf_counter())
        toks: list[int] = []
        for tok in self.llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
            timing.token_times.append(time.perf_counter())
            toks.append(tok)
            if len(toks) >= max_new_tokens:
                break
        return timing, toks


def throughput_figures(requests: list[SampleRequest], elapsed: float) -> dict:
    n_in = sum(r.prompt_len for r in requests)
    n_out = sum(r.output_len for r in requests)
    return {"elapsed_s": elapsed, "num_requests": len(requests), "prompt_tokens": n_in, "output_tokens": n_out,
            "requests_per_s": len(requests) / elapsed, "output_tok_s": n_out / elapsed,
            "total_tok_s": (n_in + n_out) / elapsed}
