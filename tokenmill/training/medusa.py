"""`tokenmill train-medusa`: Medusa heads (spec_decode/medusa.py) for a frozen target, trained on this machine's CPU.

Self-distillation, as for the EAGLE head (training/eagle.py):
1. corpus: the target's greedy answers to ShareGPT rows 1000 onward (`generate_corpus`), or, with
   `--datastore FILE`, the answers a `tokenmill build-datastore` run already produced (their prompts are
   rebuilt from the same rows, so nothing is generated twice);
2. features: one dense target pass per prompt + answer; kept only at answer positions (the heads draft
   only there);
3. training: head k at position i learns the answer token t_{i+1+k} (the target's own greedy token) by
   cross-entropy over the draft vocabulary, weighted 0.8^k as in the Medusa paper; AdamW, bf16 autocast,
   a progress bar; the state is saved after every epoch to OUT/train_state.pt and `--resume` continues;
4. evaluation on held-out sequences (the last `--held-out` of the corpus, never trained on): how often
   head k's rank-r guess is the token, written into the checkpoint (the static tree is chosen from it).

    tokenmill train-medusa --out medusa-smollm2 --datastore smollm2-datastore.npz --threads 2
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.spec_decode.medusa import MedusaHeads
from tokenmill.training.eagle import (
    add_corpus_arguments,
    choose_draft_vocab,
    corpus_from_datastore,
    extract_features,
    generate_corpus,
)

HEAD_WEIGHT_DECAY = 0.8
"""Head k's loss weight is 0.8^k (later heads are less accurate and matter less)."""


def answer_rows(
    seqs: list[list[int]], plens: list[int], feats: list[torch.Tensor], num_heads: int, vocab_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features at answer positions i (p - 1 <= i <= L - 2) and labels [n, K]: the draft-vocab index of
    t_{i+1+k}, or -100 where it is past the end or outside the draft vocabulary."""
    xs, ys = [], []
    for s, p, f in zip(seqs, plens, feats):
        L = len(s)
        if L - p < 1:
            continue
        pos = torch.arange(p - 1, L - 1)
        toks = torch.tensor(s + [-1] * (num_heads + 1))
        lab = torch.stack([toks[pos + 1 + k] for k in range(1, num_heads + 1)], dim=1)  # [n, K]
        idx = torch.where(lab >= 0, vocab_index[lab.clamp_min(0)], torch.full_like(lab, -100))
        xs.append(f[pos])
        ys.append(idx)
    return torch.cat(xs), torch.cat(ys)


def head_accuracy(
    heads: MedusaHeads, x: torch.Tensor, y: torch.Tensor, ranks: int, batch: int = 4096
) -> list[list[float]]:
    """[K][r]: how often head k's rank-r guess equals the label (over rows whose label exists)."""
    K = heads.num_heads
    hits = torch.zeros(K, ranks)
    total = torch.zeros(K)
    with torch.inference_mode():
        for i in range(0, len(x), batch):
            logits = heads(x[i : i + batch])  # [K, b, Vd]
            top = logits.topk(ranks, dim=-1).indices  # [K, b, r]
            lab = y[i : i + batch].t()  # [K, b]
            ok = lab >= 0
            hits += ((top == lab[..., None]) & ok[..., None]).sum(1).float()
            total += ok.sum(1).float()
    return (hits / total.clamp_min(1)[:, None]).tolist()


def train(
    heads: MedusaHeads,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    lr: float,
    batch: int = 2048,
    state_path: Path | None = None,
    resume: bool = False,
    bf16: bool = True,
    seed: int = 0,
) -> dict:
    """AdamW with a cosine schedule over all epochs; saves (and with resume reloads) the training state."""
    from tqdm import tqdm

    opt = torch.optim.AdamW([heads.weight, heads.bias], lr=lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(x) / batch)
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    start_epoch = 0
    if resume and state_path is not None and state_path.is_file():
        st = torch.load(state_path)
        heads.load_state_dict(st["heads"], strict=False)
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start_epoch = st["epoch"]
        print(f"resumed from {state_path} after epoch {start_epoch}")
    w = torch.tensor([HEAD_WEIGHT_DECAY**k for k in range(heads.num_heads)])
    last = {}
    for epoch in range(start_epoch, epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        bar = tqdm(range(steps_per_epoch), desc=f"epoch {epoch + 1}/{epochs}", unit="batch", disable=None)
        run_loss = 0.0
        for b in bar:
            idx = perm[b * batch : (b + 1) * batch]
            xb, yb = x[idx].float(), y[idx]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = heads(xb)  # [K, b, Vd]
            losses = torch.stack(
                [F.cross_entropy(logits[k].float(), yb[:, k], ignore_index=-100) for k in range(heads.num_heads)]
            )
            loss = (losses * w).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            value = loss.item()
            run_loss = 0.98 * run_loss + 0.02 * value if b else value
            bar.set_postfix(loss=f"{run_loss:.3f}")
        last = {"epoch": epoch + 1, "loss": run_loss}
        if state_path is not None:
            torch.save(
                {"heads": heads.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch + 1},
                state_path,
            )
    return last


def main(
    model: str,
    out: str,
    sharegpt: str,
    num_prompts: int = 3300,
    max_tokens: int = 192,
    datastore: str | None = None,
    num_heads: int = 4,
    draft_vocab_size: int = 8192,
    epochs: int = 3,
    lr: float = 1e-3,
    held_out: int = 100,
    ranks: int = 4,
    threads: int | None = None,
    resume: bool = False,
    bf16: bool = True,
) -> dict:
    from tokenmill import LLM
    from tokenmill.spec_decode.eagle_head import target_tables

    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", enable_prefix_caching=False)
    target = llm.engine.model
    corpus = (
        corpus_from_datastore(datastore, llm.tokenizer, sharegpt)
        if datastore
        else generate_corpus(llm, sharegpt, num_prompts, max_tokens)
    )
    feats, argmaxes = extract_features(target, corpus.sequences)
    V = target.config.vocab_size
    vocab = choose_draft_vocab(argmaxes, V, draft_vocab_size)
    vocab_index = torch.full((V,), -100, dtype=torch.long)
    vocab_index[vocab] = torch.arange(len(vocab))
    _, lm = target_tables(target)
    heads = MedusaHeads(target.config.hidden_size, num_heads, lm[vocab].float(), vocab, torch.float32)
    n_train = len(corpus.sequences) - held_out
    x, y = answer_rows(
        corpus.sequences[:n_train], corpus.prompt_lens[:n_train], feats[:n_train], num_heads, vocab_index
    )
    xh, yh = answer_rows(
        corpus.sequences[n_train:], corpus.prompt_lens[n_train:], feats[n_train:], num_heads, vocab_index
    )
    t_data = time.perf_counter() - t0
    before = head_accuracy(heads, xh, yh, ranks)
    Path(out).mkdir(parents=True, exist_ok=True)
    last = train(heads, x, y, epochs, lr, state_path=Path(out) / "train_state.pt", resume=resume, bf16=bf16)
    acc = head_accuracy(heads, xh, yh, ranks)
    heads.save(out, model, V, acc)
    stats = {
        "train_rows": len(x),
        "held_out_rows": len(xh),
        "data_seconds": round(t_data, 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
        **last,
        "held_out_rank_accuracy_before": before,
        "held_out_rank_accuracy": acc,
        "held_out_top1": [a[0] for a in acc],
        f"held_out_top{ranks}": [sum(a) for a in acc],
    }
    (Path(out) / "train_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats))
    return stats


def add_arguments(p) -> None:
    add_corpus_arguments(p)
    p.add_argument("--out", required=True, help="directory for the heads (medusa_config.json, model.safetensors)")
    p.add_argument(
        "--datastore",
        default=None,
        help="reuse the answers of a `tokenmill build-datastore` file instead of generating a corpus",
    )
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--draft-vocab", type=int, default=8192, help="LM-head rows the heads score (most frequent tokens)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--held-out", type=int, default=100, help="corpus sequences kept out of training for the accuracies")
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    p.add_argument("--fp32", action="store_true", help="train in float32 (default: bf16 autocast)")


def run(args) -> int:
    if not Path(args.sharegpt).is_file():
        raise ValueError(f"{args.sharegpt}: ShareGPT file not found (pass --sharegpt)")
    if args.datastore and not Path(args.datastore).is_file():
        raise ValueError(f"{args.datastore}: no datastore here (write one with `tokenmill build-datastore`)")
    main(
        args.model,
        args.out,
        args.sharegpt,
        args.num_prompts,
        args.max_tokens,
        args.datastore,
        args.num_heads,
        args.draft_vocab,
        args.epochs,
        args.lr,
        args.held_out,
        threads=args.threads,
        resume=args.resume,
        bf16=not args.fp32,
    )
    return 0
