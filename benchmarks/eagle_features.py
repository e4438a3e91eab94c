"""EAGLE with one-layer vs multi-layer target features (issue 44, item 1): two heads trained on one corpus with
the same recipe budget, their held-out greedy chain acceptance before and after, and the heads saved for
benchmarks/spec_tree.py (--eagle DIR/one-layer --eagle-multi DIR/multi-layer).

The corpus is the target's own greedy answers to ShareGPT rows 1000+ (as `tokenmill train-eagle` makes it); one
dense pass per sequence records both the final hidden states (the one-layer head's features) and the outputs of
the chosen layers (the multi-layer head's). Held out: the first 64 rows, the speculative benchmarks' prompts.

    python benchmarks/eagle_features.py --out ../shared/eagle-heads [--cache corpus.pt] [--num-prompts 1200]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tokenmill import LLM
from tokenmill.models.interface import LayerTaps
from tokenmill.spec_decode.block_drafter import default_target_layers
from tokenmill.spec_decode.datastore import SuffixDatastore
from tokenmill.training import eagle as et


@torch.inference_mode()
def both_features(model, sequences: list[list[int]], layers: tuple[int, ...]) -> tuple[list, list, list]:
    """Per sequence: final hidden states [L, H], the layers' outputs [L, len(layers) * H], the argmax [L]."""
    final, taps_out, arg = [], [], []
    t0 = time.perf_counter()
    for i, s in enumerate(sequences):
        taps = LayerTaps(layers, model.config.hidden_size)
        h = model(torch.tensor(s), torch.arange(len(s)), taps)
        assert taps.rows is not None
        final.append(h.clone())
        taps_out.append(taps.rows.clone())
        arg.append(model.compute_logits(h).argmax(-1).to(torch.int32))
        if (i + 1) % 200 == 0:
            print(f"features {i + 1}/{len(sequences)} {time.perf_counter() - t0:.0f} s", flush=True)
    return final, taps_out, arg


def build_cache(llm: LLM, sharegpt: str, num_prompts: int, max_tokens: int, datastore: str | None) -> dict:
    model = llm.engine.model
    layers = default_target_layers(model.config.num_hidden_layers)
    corpus = et.generate_corpus(llm, sharegpt, num_prompts, max_tokens)
    if datastore:  # the same answers as an offline datastore, for spec_tree.py's n-gram + datastore rows
        SuffixDatastore.save(datastore, [s[p:] for s, p in zip(corpus.sequences, corpus.prompt_lens)], 2, 6)
    ev = et.generate_corpus(llm, sharegpt, 64, max_tokens, skip_rows=0)
    f, t, a = both_features(model, corpus.sequences, layers)
    ef, etaps, ea = both_features(model, ev.sequences, layers)
    return {
        "sequences": corpus.sequences,
        "prompt_lens": corpus.prompt_lens,
        "final": f,
        "taps": t,
        "argmaxes": a,
        "ev_sequences": ev.sequences,
        "ev_prompt_lens": ev.prompt_lens,
        "ev_final": ef,
        "ev_taps": etaps,
        "ev_argmaxes": ea,
        "layers": layers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", required=True, help="directory for the two heads (one-layer/, multi-layer/)")
    ap.add_argument("--cache", default=None, help="a .pt file keeping the corpus and both features between runs")
    ap.add_argument("--datastore", default=None, help="also save the corpus answers as an offline datastore (.npz)")
    ap.add_argument(
        "--sharegpt",
        default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "sharegpt_v3_first_exchange_5000.jsonl"),
    )
    ap.add_argument("--num-prompts", type=int, default=1200)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--unroll", type=int, default=2, help="steps trained on the head's own drafts (both heads)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="one-layer,multi-layer")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype="bfloat16", enable_prefix_caching=False)
    target = llm.engine.model
    if args.cache and Path(args.cache).is_file():
        data = torch.load(args.cache)
    else:
        data = build_cache(llm, args.sharegpt, args.num_prompts, args.max_tokens, args.datastore)
        if args.cache:
            torch.save(data, args.cache)
    seqs, argmaxes = data["sequences"], data["argmaxes"]
    starts = [p - 1 for p in data["prompt_lens"]]
    ev_starts = [p - 1 for p in data["ev_prompt_lens"]]
    vocab = et.choose_draft_vocab(argmaxes, target.config.vocab_size, 8192)
    dense = et.dense_target(args.model)  # the heads' layers start as copies of its last layer
    n_tokens = sum(len(s) for s in seqs)
    print(f"corpus: {len(seqs)} sequences, {n_tokens} tokens; layers {tuple(data['layers'])}", flush=True)
    rows = []
    for kind in args.only.split(","):
        multi = kind == "multi-layer"
        layers = tuple(data["layers"]) if multi else ()
        feats, ev_feats = (data["taps"], data["ev_taps"]) if multi else (data["final"], data["ev_final"])
        head = et.init_head_from_target(dense, vocab, target_layers=layers)
        held = (data["ev_sequences"], ev_feats, data["ev_argmaxes"], ev_starts)
        before = et.chain_acceptance(head, *held, depth=5)
        t0 = time.perf_counter()
        st = et.train_head(
            head,
            seqs,
            feats,
            argmaxes,
            epochs=args.epochs,
            lr=args.lr,
            ce_weight=0.2,
            loss_start=starts,
            bf16=True,
            steps=args.unroll,
        )
        secs = time.perf_counter() - t0
        after = et.chain_acceptance(head, *held, depth=5)
        out = Path(args.out) / kind
        head.save(out, args.model)
        stats = st | {f"heldout_before_{k}": v for k, v in before.items()}
        stats |= {f"heldout_after_{k}": v for k, v in after.items()} | {"train_seconds": secs, "tokens": n_tokens}
        (out / "train_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
        rows.append((kind, before, after, st, secs))
        print(kind, json.dumps(stats), flush=True)
    print("\n| head | train | top-1 (train, step 1) | held-out accepted / 5-chain before | after | α1 | α2 | α3 |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, before, after, st, secs in rows:
        print(
            f"| {kind} | {secs / 60:.1f} min | {st['top1']:.3f} | {before['accepted']:.3f} | "
            f"**{after['accepted']:.3f}** | {after['alpha1']:.3f} | {after['alpha2']:.3f} | {after['alpha3']:.3f} |"
        )


if __name__ == "__main__":
    main()
