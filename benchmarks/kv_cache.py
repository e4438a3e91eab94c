"""KV-cache benchmarks (issue 3). Prints a markdown table per part.

  (a) TTFT of a request whose 1,024-token prefix is cached vs cold (real model, ratio).
  (b) KV waste (allocated slots not holding a token / allocated slots) with 64 concurrent ShareGPT
      requests, paged vs contiguous max-length allocation.
  (c) Requests that fit at once in a fixed KV budget, paged vs contiguous max-length.
  (d) int8 KV: concurrency gain, greedy agreement with bf16 KV over 128 tokens, WikiText-2
      perplexity delta (paged, chunked, so every chunk reads the quantized cache).

(b) and (c) replay the workload through the real scheduler and KV-cache manager with the model
replaced by fixed-length outputs (the ShareGPT reply lengths): allocation does not depend on the
token values. (a) and (d) run the default model (SmolLM2-135M).

    python benchmarks/kv_cache.py                       # all parts
    python benchmarks/kv_cache.py --parts b,c           # allocator-only parts (seconds)

Data paths are resolved relative to the repository root (../shared/data).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
SHAREGPT = DATA / "sharegpt_v3_first_exchange_5000.jsonl"
WIKITEXT = DATA / "wikitext2_raw_test.jsonl"


def table(title: str, rows: list[tuple[str, str]]) -> str:
    out = [f"### {title}", "", "| metric | value |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(out) + "\n"


def sharegpt_lengths(tokenizer, n: int, max_model_len: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt tokens, reply tokens) of n ShareGPT first exchanges, sampled with a fixed seed;
    prompt + reply is capped at max_model_len (the reply is cut)."""
    rows = [json.loads(line) for line in open(SHAREGPT)]
    random.Random(seed).shuffle(rows)
    out = []
    for r in rows:
        conv = r["conversations"]
        if len(conv) < 2:
            continue
        p = len(tokenizer.encode(conv[0]["value"]))
        o = len(tokenizer.encode(conv[1]["value"], add_special_tokens=False))
        if p < 4 or o < 4 or p >= max_model_len - 4:
            continue
        out.append((p, min(o, max_model_len - p)))
        if len(out) == n:
            break
    return out


# ------------------------------------------------------------------------------ (b) and (c)


def replay(
    lengths: list[tuple[int, int]],
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    budget: int = 2048,
    max_model_len: int = 2048,
) -> dict:
    """Run the workload through Scheduler + KVCacheManager (every step samples token 1). Waste is
    measured after each step over the steps where max_num_seqs requests run at once, paged (the
    allocator's own counters) and contiguous (each running request reserving max_model_len)."""
    from tokenmill.config import CacheConfig, SchedulerConfig
    from tokenmill.core.scheduler import SamplerResult, Scheduler
    from tokenmill.request import Request
    from tokenmill.sampling_params import SamplingParams

    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        CacheConfig(block_size=block_size, enable_prefix_caching=False),
        num_blocks,
        1 << 20,
    )
    rng = random.Random(0)
    for i, (p, o) in enumerate(lengths):
        sp = SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
        sched.add_request(Request(str(i), [rng.randrange(1000) for _ in range(p)], sp, None, o))
    alloc = filled = contiguous = 0
    peak_running = 0
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, {s.request_id: SamplerResult([1]) for s in out.scheduled if s.is_sampling})
        mem = sched.kv.memory_usage({r.request_id: min(r.num_computed_tokens, r.num_tokens) for r in sched.running})
        peak_running = max(peak_running, len(sched.running))
        if len(sched.running) == max_num_seqs:
            alloc += mem.num_allocated_slots
            filled += mem.num_filled_slots
            contiguous += max_num_seqs * max_model_len
        steps += 1
    sched.check_integrity()
    return {
        "waste": 1 - filled / alloc if alloc else None,
        "contiguous_waste": 1 - filled / contiguous if contiguous else None,
        "peak_running": peak_running,
        "steps": steps,
        "preemptions": sched.num_preemptions,
    }


def part_b(tokenizer, block_size: int, max_model_len: int, num_requests: int = 640) -> str:
    """64 requests in flight at all times: num_requests ShareGPT requests, 64 running at once, a
    finished one replaced by the next; waste averaged over the steps where 64 run."""
    lengths = sharegpt_lengths(tokenizer, num_requests, max_model_len)
    num_blocks = 64 * math.ceil(max_model_len / block_size)  # room for 64 of any length: no preemption
    r = replay(lengths, num_blocks, block_size, max_num_seqs=64, max_model_len=max_model_len)
    return table(
        f"(b) KV waste, 64 concurrent ShareGPT requests (block_size {block_size}, max_model_len {max_model_len})",
        [
            (
                "workload",
                f"{num_requests} requests, 64 in flight; mean prompt {statistics.mean(p for p, _ in lengths):.0f}, "
                f"mean reply {statistics.mean(o for _, o in lengths):.0f} tokens",
            ),
            ("paged: allocated slots not holding a token", f"{r['waste']:.2%}"),
            ("contiguous max-length: reserved slots not holding a token", f"{r['contiguous_waste']:.2%}"),
            ("engine steps / preemptions", f"{r['steps']} / {r['preemptions']}"),
        ],
    )


def part_c(tokenizer, block_size: int, max_model_len: int, budget_seqs: int = 8) -> str:
    budget_tokens = budget_seqs * max_model_len
    lengths = sharegpt_lengths(tokenizer, 1000, max_model_len, seed=1)
    # static: how many requests at their final length fit in the budget, taken in dataset order
    used = n_static = 0
    for p, o in lengths:
        need = math.ceil((p + o) / block_size)
        if (used + need) * block_size > budget_tokens:
            break
        used += need
        n_static += 1
    return table(
        f"(c) Requests that fit at once in a {budget_tokens}-token KV budget "
        f"({budget_seqs} x max_model_len {max_model_len})",
        [
            ("contiguous max-length allocation", f"{budget_seqs}"),
            ("paged, requests at their final length (static packing)", f"{n_static} ({n_static / budget_seqs:.1f}x)"),
        ],
    )


# ------------------------------------------------------------------------------------------ (a)


def part_a(model: str, repeats: int = 3) -> str:
    from tokenmill import SamplingParams
    from tokenmill.engine.llm import LLM

    llm = LLM(model, dtype="float32", max_num_batched_tokens=2048, max_model_len=2048, kv_cache_memory_bytes=512 << 20)
    vocab = llm.engine.arch.vocab_size
    rng = random.Random(0)

    def toks(n: int) -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(n)]

    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft(prompt: list[int]) -> tuple[float, int]:
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        return out.metrics.ttft, out.num_cached_tokens

    ttft(toks(1040))  # warm-up (allocations, first-call overheads)
    cold, warm, cached = [], [], []
    for _ in range(repeats):
        prefix = toks(1024)
        t, c = ttft(prefix + toks(16))  # cold: nothing of it is cached
        assert c == 0
        cold.append(t)
        t, c = ttft(prefix + toks(16))  # same prefix, new suffix
        warm.append(t)
        cached.append(c)
    llm.check_integrity()
    c, w = statistics.median(cold), statistics.median(warm)
    return table(
        "(a) TTFT, 1,024-token prefix cached vs cold (SmolLM2-135M fp32, prompt 1,040 tokens)",
        [
            (f"cold TTFT (median of {repeats:d})", f"{c * 1e3:.1f} ms"),
            (f"cached TTFT (median of {repeats:d})", f"{w * 1e3:.1f} ms"),
            ("tokens served from cache", f"{cached[0]}"),
            ("ratio cold / cached", f"{c / w:.1f}x"),
        ],
    )


# ------------------------------------------------------------------------------------------ (d)


@torch.inference_mode()
def paged_forward(
    model, arch, tokens: list[int], kv_dtype: torch.dtype, chunks: list[int], block_size: int = 16
) -> tuple[float, int, list[int]]:
    """Run tokens through the paged cache in the given chunk sizes (so every chunk after the first
    attends to keys/values read back from the cache). Returns the summed next-token NLL, the number
    of predicted tokens and the argmax prediction after every position."""
    from tokenmill.attention.kv_quant import cache_head_dim
    from tokenmill.attention.metadata import AttentionMetadata, forward_context

    n = len(tokens)
    nb = math.ceil(n / block_size)
    caches = [
        torch.zeros(
            2, nb, block_size, arch.num_key_value_heads, cache_head_dim(arch.head_dim, kv_dtype), dtype=kv_dtype
        )
        for _ in range(arch.num_hidden_layers)
    ]
    for attn, c in zip(model.attention_layers(), caches):
        attn.kv_cache = c
    table_ = torch.arange(nb)[None]
    ids = torch.tensor(tokens)
    nll, count, argmax = 0.0, 0, []
    bounds = [0]
    for c in chunks:
        bounds.append(min(n, bounds[-1] + c))
    for start, end in zip(bounds, bounds[1:]):
        m = end - start
        if m == 0:
            break
        meta = AttentionMetadata(
            num_decodes=1 if m == 1 else 0,
            num_prefills=0 if m == 1 else 1,
            slot_mapping=torch.arange(start, end),
            block_tables=table_,
            seq_lens=torch.tensor([end]),
            query_start_loc=torch.tensor([0, m]),
            seq_lens_cpu=[end],
            query_start_loc_cpu=[0, m],
            max_decode_seq_len=end if m == 1 else 0,
            decode_mask=(torch.arange(math.ceil(end / block_size) * block_size) < end)[None, None, None, :]
            if m == 1
            else None,
        )
        with forward_context(meta):
            hidden = model(ids[start:end], torch.arange(start, end))
        logits = model.compute_logits(hidden).float()
        argmax += logits.argmax(-1).tolist()
        tgt = ids[start + 1 : end + 1]
        lp = logits[: len(tgt)].log_softmax(-1)
        nll -= lp.gather(1, tgt[:, None]).sum().item()
        count += len(tgt)
    for attn in model.attention_layers():
        attn.kv_cache = None
    return nll, count, argmax


def part_d(
    model: str, num_prompts: int = 8, gen_tokens: int = 128, windows: int = 4, window_len: int = 512, chunk: int = 64
) -> str:
    from tokenmill import SamplingParams
    from tokenmill.engine.llm import LLM
    from tokenmill.models.loader import load_model

    rows = []
    # concurrency: the same byte budget in tokens, and ShareGPT requests that fit in it
    llms = {
        d: LLM(
            model,
            dtype="bfloat16",
            kv_cache_dtype=d,
            kv_cache_memory_bytes=256 << 20,
            max_num_seqs=64,
            max_model_len=2048,
            max_num_batched_tokens=2048,
        )
        for d in ("auto", "int8")
    }
    st = {d: llm.stats() for d, llm in llms.items()}
    rows.append(
        (
            "KV bytes per token, bf16 / int8",
            f"{st['auto'].kv_bytes_per_token:.0f} / {st['int8'].kv_bytes_per_token:.0f}",
        )
    )
    tok = llms["auto"].tokenizer
    lengths = sharegpt_lengths(tok, 2000, 2048, seed=2)
    fits = {}
    for d in ("auto", "int8"):
        blocks, used, n = st[d].num_blocks_total, 0, 0
        for p, o in lengths:
            need = math.ceil((p + o) / st[d].block_size)
            if used + need > blocks:
                break
            used, n = used + need, n + 1
        fits[d] = n
    rows.append(
        (
            "tokens in a 256 MiB KV budget, bf16 / int8",
            f"{st['auto'].kv_pool_tokens} / {st['int8'].kv_pool_tokens} "
            f"({st['int8'].kv_pool_tokens / st['auto'].kv_pool_tokens:.2f}x)",
        )
    )
    rows.append(
        (
            "ShareGPT requests (final length) fitting that budget, bf16 / int8",
            f"{fits['auto']} / {fits['int8']} ({fits['int8'] / max(fits['auto'], 1):.2f}x)",
        )
    )
    # greedy agreement over 128 tokens
    prompts = [r["conversations"][0]["value"] for r in map(json.loads, open(SHAREGPT))][:num_prompts]
    sp = SamplingParams(temperature=0, max_tokens=gen_tokens, ignore_eos=True)
    results = {d: llm.generate(prompts, sp, use_tqdm=False) for d, llm in llms.items()}
    outs = {d: [o.outputs[0].token_ids for o in r] for d, r in results.items()}
    prompt_ids = [o.prompt_token_ids for o in results["auto"]]
    same = sum(a == b for x, y in zip(outs["auto"], outs["int8"]) for a, b in zip(x, y))
    prefix = []
    for x, y in zip(outs["auto"], outs["int8"]):
        k = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
        prefix.append(k)
    rows.append(
        (
            f"greedy, free-running: {num_prompts} ShareGPT prompts x {gen_tokens} tokens, int8 vs bf16 KV",
            f"{sum(k == gen_tokens for k in prefix)}/{num_prompts} identical; mean common prefix "
            f"{statistics.mean(prefix):.0f} tokens; same token at {same / (num_prompts * gen_tokens):.1%} of positions",
        )
    )
    del llms
    loaded = load_model(model, dtype=torch.bfloat16)
    # teacher-forced: along each bf16-KV greedy continuation, one token per step (decode path reading
    # the cache), does the int8-KV model pick the same next token?
    agree = total = 0
    for p_ids, out in zip(prompt_ids, outs["auto"]):
        seq = list(p_ids) + list(out)
        chunks = [len(p_ids)] + [1] * (len(out) - 1)
        preds = {}
        for name, dt in (("bf16", torch.bfloat16), ("int8", torch.int8)):
            preds[name] = paged_forward(loaded.model, loaded.config, seq[:-1], dt, chunks)[2][len(p_ids) - 1 :]
        agree += sum(a == b for a, b in zip(preds["bf16"], preds["int8"]))
        total += len(preds["bf16"])
    rows.append(
        (
            f"greedy, teacher-forced on the bf16 continuations ({total} decode steps)",
            f"int8 KV picks the bf16-KV token at {agree / total:.1%} of steps",
        )
    )
    # WikiText-2 perplexity
    text = "\n\n".join(json.loads(line)["text"] for line in open(WIKITEXT))
    ids = loaded.tokenizer.encode(text)
    ppl = {}
    for name, dt in (("bf16", torch.bfloat16), ("int8", torch.int8)):
        nll = cnt = 0
        for w in range(windows):
            s, c, _ = paged_forward(
                loaded.model,
                loaded.config,
                ids[w * window_len : (w + 1) * window_len],
                dt,
                [chunk] * math.ceil(window_len / chunk),
            )
            nll, cnt = nll + s, cnt + c
        ppl[name] = math.exp(nll / cnt)
    rows.append(
        (
            f"WikiText-2 perplexity, bf16 KV / int8 KV ({windows} windows x {window_len} tokens, chunks of {chunk})",
            f"{ppl['bf16']:.3f} / {ppl['int8']:.3f} (delta {ppl['int8'] - ppl['bf16']:+.3f}, "
            f"{(ppl['int8'] / ppl['bf16'] - 1):+.2%})",
        )
    )
    return table("(d) int8 KV cache vs bf16 KV (SmolLM2-135M, bf16 weights and activations)", rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="a,b,c,d")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    if os.environ.get("TOKENMILL_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["TOKENMILL_NUM_THREADS"]))
    parts = set(args.parts.split(","))
    tokenizer = None
    if parts & {"b", "c"}:
        from tokenmill.models.loader import GGUFSource, resolve_model_path

        tokenizer = GGUFSource(resolve_model_path(args.model)).tokenizer()
    t0 = time.time()
    if "a" in parts:
        print(part_a(args.model), flush=True)
    if "b" in parts:
        print(part_b(tokenizer, args.block_size, args.max_model_len), flush=True)
    if "c" in parts:
        print(part_c(tokenizer, args.block_size, args.max_model_len), flush=True)
    if "d" in parts:
        print(part_d(args.model), flush=True)
    print(f"_total {time.time() - t0:.0f} s_")


if __name__ == "__main__":
    main()
