"""Our engine under the benchmark workloads: timed single-stream generation and offline throughput."""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import fields

from tokenmill.bench.common import SampleRequest
from tokenmill.bench.peers import StreamTiming, throughput_figures
from tokenmill.config import CacheConfig, ModelConfig, SchedulerConfig
from tokenmill.sampling_params import SamplingParams

_ids = itertools.count()

# A neutral English passage; latency prompts are cut from (repetitions of) it.
PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when movable type made it "
    "possible to reproduce books far faster than scribes could copy them. Within a few decades, "
    "presses spread across Europe, prices fell, and literacy began to rise. "
)


def engine_kwargs(args: argparse.Namespace, **overrides) -> dict:
    """LLM(...) keyword arguments from parsed engine flags (entrypoints.engine_args), with overrides."""
    kw = {}
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        for f in fields(cls):
            if hasattr(args, f.name):
                kw[f.name] = getattr(args, f.name)
    if getattr(args, "speculative_config", None) is not None:
        kw["speculative_config"] = args.speculative_config
    kw.update(overrides)
    return kw


def make_prompt_ids(tokenizer, input_len: int) -> list[int]:
    """A real-text prompt of exactly input_len tokens."""
    ids: list[int] = []
    while len(ids) < input_len:
        ids += tokenizer.encode(PASSAGE, add_special_tokens=False)
    return ids[:input_len]


def engine_timed_generate(
    engine, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams | None = None
) -> tuple[StreamTiming, list[int]]:
    """Greedy batch-1 generation on an EngineCore with a timestamp per generated token (tokens of a
    multi-token step, e.g. accepted drafts, share its timestamp)."""
    params = params or SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    rid = f"bench-{next(_ids)}"
    timing = StreamTiming(time.perf_counter())
    engine.add_request(rid, list(prompt_ids), params)
    toks: list[int] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id == rid:
                new = o.outputs[0].token_ids[len(toks) :]
                toks.extend(new)
                timing.token_times.extend([now] * len(new))
    return timing, toks


def engine_throughput(llm, requests: list[SampleRequest]) -> dict:
    """Offline throughput: every request submitted at once, greedy, exactly output_len tokens each."""
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    want = sum(r.output_len for r in requests)
    assert got == want, f"engine produced {got} tokens, expected {want}"
    return throughput_figures(requests, elapsed)


def warm_up(llm) -> None:
    """One short prefill + decode (builds the C++ kernel and warms allocator caches)."""
    llm.generate(
        [{"prompt_token_ids": make_prompt_ids(llm.tokenizer, 24)}] * 2,
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
