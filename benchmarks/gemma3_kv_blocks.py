"""KV blocks a long Gemma 3 request holds, sliding-window layers vs every layer global (issue 20).

The real model (gemma3-270m, 18 layers: 3 global, 15 with a 512-token window) serves one request of a
4,000-token WikiText prompt plus 32 generated tokens; after every engine step the pool's used blocks are read
(EngineStats.num_blocks_used, per kind of group). The all-global figure is the same request replayed through
the same scheduler and KV-cache manager with every group global (allocation does not depend on the token
values); the windowed replay is printed beside it as a check that the replay matches the engine.

    python benchmarks/gemma3_kv_blocks.py [--prompt-tokens 4000] [--block-size 16] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext2_raw_test.jsonl"


def wikitext_ids(tokenizer, n: int) -> list[int]:
    text = ""
    for line in WIKITEXT.open():
        text += json.loads(line)["text"]
        ids = tokenizer.encode(text)
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit("wikitext too short")


def replay(groups, prompt: list[int], max_tokens: int, block_size: int, chunk: int) -> tuple[int, int]:
    """(peak used blocks, peak while decoding) of the request through the real scheduler (fixed output
    tokens, no model)."""
    from tokenmill.config import CacheConfig, SchedulerConfig
    from tokenmill.core.scheduler import Scheduler
    from tokenmill.core.step_io import SamplerResult
    from tokenmill.request import Request
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=chunk),
        CacheConfig(block_size=block_size),
        100_000,
        100_000,
        kv_groups=groups,
    )
    sched.add_request(Request("r", prompt, params, None, max_tokens))
    peak = decode_peak = 0
    while sched.has_unfinished():
        out = sched.schedule()
        used = sched.kv.pool.num_blocks - sched.kv.pool.num_free_blocks
        peak = max(peak, used)
        if all(s.num_new_tokens == 1 for s in out.scheduled):
            decode_peak = max(decode_peak, used)
        sched.update(out, {s.request_id: SamplerResult([7]) for s in out.scheduled if s.is_sampling})
    return peak, decode_peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from tokenmill.config import EngineConfig, KVCacheGroup, plan_kv_groups
    from tokenmill.engine.core import EngineCore
    from tokenmill.sampling_params import SamplingParams

    engine = EngineCore(
        EngineConfig.from_kwargs(
            model="gemma3-270m",
            dtype=args.dtype,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=512 << 20,
        )
    )
    prompt = wikitext_ids(engine.tokenizer, args.prompt_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine.add_request("r", prompt, params)
    peak, by_kind, decode_peak, decode_kind, t0 = 0, {}, 0, {}, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        st = engine.stats()
        if st.num_blocks_used > peak:
            peak, by_kind = st.num_blocks_used, dict(st.num_blocks_used_by_kind)
        if st.num_generation_tokens > 1 and st.num_blocks_used > decode_peak:  # the prompt is done: decoding
            decode_peak, decode_kind = st.num_blocks_used, dict(st.num_blocks_used_by_kind)
    elapsed = time.perf_counter() - t0
    st = engine.stats()
    groups = plan_kv_groups(engine.arch.layer_windows())
    all_global = [KVCacheGroup(g.layers, None) for g in groups]
    n = len(prompt)
    windowed_replay, windowed_decode = replay(
        groups, prompt, args.max_tokens, args.block_size, args.max_num_batched_tokens
    )
    global_replay, global_decode = replay(
        all_global, prompt, args.max_tokens, args.block_size, args.max_num_batched_tokens
    )
    block_bytes = engine.kv_spec.bytes_per_block
    res = {
        "model": "gemma3-270m",
        "prompt_tokens": n,
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "groups": [{"layers": list(g.layers), "window": g.sliding_window} for g in groups],
        "peak_blocks_engine": peak,
        "peak_blocks_by_kind": by_kind,
        "blocks_slid_out": st.num_blocks_slid_out,
        "peak_blocks_replay_windowed": windowed_replay,
        "peak_blocks_replay_all_global": global_replay,
        "ratio_all_global_over_windowed": global_replay / peak,
        "bytes_per_block": block_bytes,
        "decode_blocks_engine": decode_peak,
        "decode_blocks_by_kind": decode_kind,
        "decode_blocks_replay_windowed": windowed_decode,
        "decode_blocks_replay_all_global": global_decode,
        "decode_ratio_all_global_over_windowed": global_decode / decode_peak,
        "peak_mib_windowed": peak * block_bytes / 2**20,
        "peak_mib_all_global": global_replay * block_bytes / 2**20,
        "engine_seconds": elapsed,
    }
    print(
        f"### Gemma 3 270M: KV blocks held by one {n}-token request (+{args.max_tokens} generated), "
        f"{args.block_size}-token blocks of {len(groups[0].layers)} layers ({block_bytes / 1024:.0f} KiB)\n"
    )
    kinds = lambda d: ", ".join(f"{k}: {v}" for k, v in d.items())  # noqa: E731
    print("| | peak blocks (during a 512-token prompt chunk) | blocks while decoding |\n|---|---|---|")
    print(f"| sliding windows (engine) | {peak} ({kinds(by_kind)}) | {decode_peak} ({kinds(decode_kind)}) |")
    print(f"| sliding windows (replay) | {windowed_replay} | {windowed_decode} |")
    print(f"| every layer global (replay) | {global_replay} | {global_decode} |")
    print(
        f"| all-global / windowed | {res['ratio_all_global_over_windowed']:.2f}x | "
        f"{res['decode_ratio_all_global_over_windowed']:.2f}x |"
    )
    print(
        f"\n{block_bytes / 1024:.0f} KiB per block; {st.num_blocks_slid_out} blocks returned by the windows; "
        f"engine run {elapsed:.1f} s"
    )
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
