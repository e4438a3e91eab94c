"""Token trees vs chains (issue 17): for each proposer, chain and tree speculation against plain decoding in
the same run, at batch 1, 8 and 32, greedy and temperature 0.7, on ShareGPT chat prompts.

Columns:
    acc. len   tokens emitted per verified draft (1 + accepted / drafts)
    nodes      draft tokens (tree nodes) per verified draft
    r          a speculative step's target time / a plain decode step's (verification is not free)
    c          proposer time per step / a plain decode step
    drafted    share of speculative steps that carried a draft (coverage)
    predicted  tokens per step / (r + c), with tokens per step = drafted x acc. len + (1 - drafted)
    measured   plain wall time / speculative wall time, same prompts and lengths (ignore_eos)
    same       greedy rows: the speculative tokens equal plain decoding's

    python benchmarks/spec_tree.py --datastore FILE [--medusa DIR] [--eagle DIR] [--eagle-multi DIR]
        [--dflash [DIR]] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_decode import sharegpt_prompts  # noqa: E402  (benchmarks/spec_decode.py)

from tokenmill import LLM, SamplingParams  # noqa: E402


def run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int, temperature: float) -> dict:
    """Prompts in waves of `batch`; times every step and the proposer."""
    eng = llm.engine
    params = [
        SamplingParams(
            temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=None if temperature == 0 else i
        )
        for i in range(len(prompts))
    ]
    speculator = eng.executor.runner.speculator  # in-process: it times its own proposer
    steps_with_drafts = [0]
    if speculator is not None:
        speculator.reset_stats()
    tokens: list[list[int]] = []
    step_s: list[float] = []
    t_start = time.perf_counter()
    for w in range(0, len(prompts), batch):
        ids = []
        for j, p in enumerate(prompts[w : w + batch]):
            rid = f"t{time.perf_counter_ns()}-{w + j}"
            eng.add_request(rid, p, params[w + j])
            ids.append(rid)
        done: dict[str, list[int]] = {}
        while len(done) < len(ids):
            has_drafts = any(r.spec_token_ids for r in eng.scheduler.running)
            t0 = time.perf_counter()
            outs = eng.step()
            step_s.append(time.perf_counter() - t0)
            steps_with_drafts[0] += has_drafts
            for o in outs:
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        tokens.extend(done[i] for i in ids)
    wall = time.perf_counter() - t_start
    llm.check_integrity()
    spec = dict(llm.stats().spec_decode)
    return {
        "tokens": tokens,
        "wall": wall,
        "steps": step_s,
        "propose_s": spec.get("draft_seconds", 0.0),
        "drafted": steps_with_drafts[0] / max(len(step_s), 1),
        "spec": spec,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--datastore", default=None, help="tokenmill build-datastore output: adds ngram+datastore rows")
    ap.add_argument("--medusa", default=None, help="tokenmill train-medusa output: adds medusa rows")
    ap.add_argument("--eagle", default=None, help="tokenmill train-eagle output: adds eagle rows")
    ap.add_argument(
        "--eagle-multi", default=None, help="a multi-layer EAGLE head (train-eagle --feature-layers): adds its rows"
    )
    ap.add_argument(
        "--dflash",
        nargs="?",
        const="shipped",
        default=None,
        help="adds block-drafter rows: the drafter shipped for the model (no value) or a train-drafter directory",
    )
    ap.add_argument("--dflash-gamma", type=int, default=7, help="block drafter chain length (at most block size - 1)")
    ap.add_argument("--num-prompts", type=int, default=8, help="single-stream prompts")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request at batch 1")
    ap.add_argument("--batch-max-tokens", type=int, default=32, help="tokens per request at batch 8 and 32")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--only", default=None, help="comma-separated config names to run (plain always runs)")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--gamma", type=int, default=5, help="chain length, and the trees' depth")
    ap.add_argument("--tree-nodes", type=int, default=12)
    ap.add_argument("--tree-width", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--adaptive-single",
        action="store_true",
        help="adaptive speculation at batch 1 too (default: pinned γ and tree size at batch 1)",
    )
    ap.add_argument(
        "--gguf-dequantize",
        action="store_true",
        help="a GGUF target dequantized to --dtype at load (dense kernels) instead of run on its own blocks",
    )
    args = ap.parse_args()
    if args.threads:
        os.environ["TOKENMILL_NUM_THREADS"] = str(args.threads)
    torch.manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    common = dict(
        dtype=args.dtype,
        max_model_len=1024,
        max_num_seqs=max(batches),
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
        gguf_dequantize=args.gguf_dequantize,
    )
    tree = {"max_nodes": args.tree_nodes, "max_width": args.tree_width}
    configs: dict[str, dict | None] = {"plain": None}
    ngram = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1, "num_speculative_tokens": args.gamma}
    configs["ngram chain"] = ngram
    configs["ngram tree"] = {**ngram, "tree": tree}
    if args.datastore:
        ds = {**ngram, "datastore": args.datastore}
        configs["ngram+datastore chain"] = ds
        configs["ngram+datastore tree"] = {**ds, "tree": tree}
    if args.medusa:
        md = {"method": "medusa", "model": args.medusa, "num_speculative_tokens": args.gamma}
        configs["medusa chain"] = {**md, "tree": {"max_nodes": args.gamma, "max_width": 1}}
        configs["medusa tree"] = {**md, "tree": tree}
        if args.datastore:
            configs["medusa+ngram+datastore tree"] = {
                **md,
                "tree": tree,
                "datastore": args.datastore,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 1,
            }
    if args.eagle:
        eg = {"method": "eagle", "model": args.eagle, "num_speculative_tokens": args.gamma}
        configs["eagle chain"] = eg
        configs["eagle tree"] = {**eg, "tree": tree}
    if args.eagle_multi:
        em = {"method": "eagle", "model": args.eagle_multi, "num_speculative_tokens": args.gamma}
        configs["eagle multi-layer chain"] = em
        configs["eagle multi-layer tree"] = {**em, "tree": tree}
    if args.dflash:
        df = {"method": "dflash", "num_speculative_tokens": args.dflash_gamma}
        if args.dflash != "shipped":
            df["model"] = args.dflash
        configs["dflash chain"] = df
        configs["dflash chain (drafter only)"] = {**df, "choose_proposer": False}
        configs["dflash tree"] = {**df, "tree": tree}
        configs["dflash tree (drafter only)"] = {**df, "tree": tree, "choose_proposer": False}
    if args.only:
        keep = set(args.only.split(","))
        configs = {k: v for k, v in configs.items() if k == "plain" or k in keep}
    engines: dict[str, LLM] = {}
    for name, spec in configs.items():
        kw = dict(common)
        if spec is not None:
            kw["speculative_config"] = spec
        engines[name] = LLM(args.model, **kw)
    prompts = sharegpt_prompts(engines["plain"].tokenizer, max(batches + [args.num_prompts]), 256)
    for llm in engines.values():  # warm-up
        run(llm, prompts[:1], 1, 8, 0.0)
    dequantized = " (GGUF dequantized)" if args.gguf_dequantize else ""
    print(
        f"# token trees vs chains, {args.model} {args.dtype}{dequantized}, γ (chain length, tree depth) {args.gamma}, "
        f"trees of "
        f"≤ {args.tree_nodes} nodes, width ≤ {args.tree_width}; batch 1: {args.num_prompts} prompts x "
        f"{args.max_tokens} tokens one at a time, batch 8/32: {args.batch_max_tokens} tokens each; "
        f"speculation {'adaptive' if args.adaptive_single else 'pinned'} at batch 1, "
        f"adaptive (the default) at 8 and 32\n"
    )
    print("| batch | T | config | tok/s | acc. len | nodes | drafted | r | c | predicted | measured | same |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for b in batches:
        wave = prompts[: args.num_prompts] if b == 1 else prompts[:b]
        n_tok = args.max_tokens if b == 1 else args.batch_max_tokens
        for t in temps:
            base = run(engines["plain"], wave, b, n_tok, t)
            print(
                f"| {b} | {t} | plain | {len(wave) * n_tok / base['wall']:.1f} | - | - | - | - | - | - | 1.00x | - |",
                flush=True,
            )
            for name, llm in engines.items():
                if name == "plain":
                    continue
                llm.engine.executor.runner.speculator.adaptive.adaptive = b > 1 or args.adaptive_single
                r = run(llm, wave, b, n_tok, t)
                # plain again right after: the ratio is against the mean of the plain runs around it (noisy host)
                after = run(engines["plain"], wave, b, n_tok, t)
                plain_wall = (base["wall"] + after["wall"]) / 2
                t_step = statistics.median(base["steps"] + after["steps"])
                st = r["spec"]
                acc = st.get("mean_acceptance_length", 0.0)
                steps = len(r["steps"])
                ratio = (r["wall"] - r["propose_s"]) / steps / (plain_wall / len(base["steps"]))
                c = r["propose_s"] / steps / t_step
                per_step = r["drafted"] * acc + (1 - r["drafted"]) if acc else 1.0
                same = "-" if t else ("yes" if r["tokens"] == base["tokens"] else "no")
                print(
                    f"| {b} | {t} | {name} | {len(wave) * n_tok / r['wall']:.1f} | {acc:.2f} | "
                    f"{st.get('mean_draft_size', 0):.1f} | {r['drafted']:.2f} | {ratio:.2f} | {c:.3f} | "
                    f"{per_step / (ratio + c):.2f}x | {plain_wall / r['wall']:.2f}x | {same} |",
                    flush=True,
                )
                base = after


if __name__ == "__main__":
    main()
