"""Train an EAGLE draft head (spec_decode/eagle_head.py) for a target model, on this machine's CPU.

Self-distillation in three stages, each a function so a benchmark or test can run one alone:

1. `generate_corpus`: the target answers ShareGPT first turns greedily (our engine, batched).
   The prompts are rows [skip_rows:] of the file shuffled with seed 0; the speculative-decoding
   benchmark draws its prompts from the front of the same order, so the two never overlap.
2. `extract_features`: one dense target pass per prompt + answer records the feature at every
   position (the final hidden state, after the final norm) and the target's argmax there.
3. `train_head`: the head learns, at each position i, (f_i, t_{i+1}) -> f_{i+1}, with a
   smooth-L1 loss on the feature and a cross-entropy on the target's argmax at i + 1 over the
   draft vocabulary (the most frequent argmax tokens), scored on answer positions only (the head
   drafts only there; prompt positions still give attention context). Inputs get Gaussian
   noise, as EAGLE does, so the head tolerates its own imperfect predictions when it drafts
   several tokens. bf16 autocast trains ~3x faster than float32 on an AVX512-BF16 CPU.

    tokenmill train-eagle --model smollm2-135m --out ../shared/eagle-smollm2-135m
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.models.interface import LayerTaps
from tokenmill.spec_decode.eagle_head import EagleHead, head_arch, target_tables, train_forward


@dataclass
class Corpus:
    sequences: list[list[int]]
    """prompt + greedy answer token ids."""
    prompt_lens: list[int]


def sharegpt_rows(path: str | Path, seed: int = 0) -> list[dict]:
    rows = [json.loads(line) for line in open(path)]
    random.Random(seed).shuffle(rows)
    return rows


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": text}], True), add_special_tokens=False
    )


def generate_corpus(
    llm,
    sharegpt: str | Path,
    num_prompts: int,
    max_tokens: int,
    skip_rows: int = 1000,
    max_prompt_tokens: int = 384,
    batch: int = 64,
    log=print,
    temperature: float = 0.0,
    seed: int = 0,
) -> Corpus:
    """The target's answers to the first `num_prompts` usable ShareGPT first turns from row `skip_rows` of the
    shuffled file: greedy, or sampled at `temperature` with request i seeded `seed + i` (reproducible)."""
    from tokenmill import SamplingParams

    tok = llm.tokenizer
    prompts: list[list[int]] = []
    for r in sharegpt_rows(sharegpt)[skip_rows:]:
        ids = chat_prompt_ids(tok, r["conversations"][0]["value"])
        if 4 <= len(ids) <= max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == num_prompts:
            break
    eng = llm.engine
    seqs: list[list[int]] = []
    t0 = time.perf_counter()
    for w in range(0, len(prompts), batch):
        ids = []
        for j, p in enumerate(prompts[w : w + batch]):
            rid = f"eagle-corpus-{w + j}"
            seeded = {"seed": seed + w + j} if temperature > 0 else {}
            eng.add_request(rid, p, SamplingParams(temperature=temperature, max_tokens=max_tokens, **seeded))
            ids.append(rid)
        done: dict[str, list[int]] = {}
        while len(done) < len(ids):
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
        seqs.extend(prompts[w + j] + done[rid] for j, rid in enumerate(ids))
        n_out = sum(len(s) for s in seqs) - sum(len(p) for p in prompts[: len(seqs)])
        log(f"corpus: {len(seqs)}/{len(prompts)} prompts, {n_out} answer tokens, {time.perf_counter() - t0:.0f} s")
    return Corpus(seqs, [len(p) for p in prompts])


def corpus_from_datastore(
    path: str | Path, tokenizer, sharegpt: str | Path, skip_rows: int = 1000, max_prompt_tokens: int = 384
) -> Corpus:
    """The corpus a build-datastore run answered: its answers (the file's sequences, in order) after the prompts
    generate_corpus chose for them (same rows, same filter)."""
    with np.load(path) as f:
        flat = f["tokens"].astype(np.int64)
    ends = np.flatnonzero(flat < 0)
    answers, start = [], 0
    for e in ends:
        answers.append(flat[start:e].tolist())
        start = e + 1
    prompts: list[list[int]] = []
    for r in sharegpt_rows(sharegpt)[skip_rows:]:
        ids = chat_prompt_ids(tokenizer, r["conversations"][0]["value"])
        if 4 <= len(ids) <= max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == len(answers):
            break
    if len(prompts) != len(answers):
        raise ValueError(f"{path}: {len(answers)} answers but only {len(prompts)} prompts in {sharegpt}")
    return Corpus([p + a for p, a in zip(prompts, answers)], [len(p) for p in prompts])


@torch.inference_mode()
def extract_features(
    model, sequences: list[list[int]], layers: tuple[int, ...] = (), log=print
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: features [L, F] (the model's dtype) and the target's argmax [L] (int32). The features are the
    final hidden states (after the final norm, F = H), or with `layers` those layers' outputs side by side
    (LayerTaps, F = len(layers) * H): a multi-layer EAGLE head's and the block drafter's."""
    feats, argmaxes = [], []
    t0 = time.perf_counter()
    for i, s in enumerate(sequences):
        taps = LayerTaps(layers, model.config.hidden_size) if layers else None
        h = model(torch.tensor(s, dtype=torch.long), torch.arange(len(s)), taps)
        if taps is not None:
            assert taps.rows is not None  # the body filled it
            feats.append(taps.rows.clone())
        else:
            feats.append(h.clone())
        argmaxes.append(model.compute_logits(h).argmax(-1).to(torch.int32))
        if (i + 1) % 200 == 0 or i + 1 == len(sequences):
            log(f"features: {i + 1}/{len(sequences)} sequences, {time.perf_counter() - t0:.0f} s")
    return feats, argmaxes


def choose_draft_vocab(argmaxes: list[torch.Tensor], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` tokens the target predicts most often (sorted ids), ties by id."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for a in argmaxes:
        counts += torch.bincount(a.long(), minlength=vocab_size)
    top = torch.argsort(-counts, stable=True)[:size]
    return top.sort().values


def dense_target(model: str):
    """The target with dense float32 weights (a GGUF file's dequantized), whose last layer a new head copies: the
    served target's matrices may be packed for its kernels, with no plain `weight` to copy."""
    from tokenmill import LLM

    return LLM(model, dtype="float32", gguf_dequantize=True, enable_prefix_caching=False, max_num_seqs=1).engine.model


def init_head_from_target(
    target, draft_vocab: torch.Tensor, seed: int = 0, target_layers: tuple[int, ...] = ()
) -> EagleHead:
    """A float32 head whose layer starts as a copy of the target's last layer, its norm as the
    target's final norm, and fc as [small random | identity] so it starts by passing f_i on.
    Multi-layer (`target_layers`, the last target layer among them): fuse starts as the identity on the last
    layer's part (zeros elsewhere: their gradients are not zero) and fuse_norm as the final norm, so the fused
    feature starts as exactly the final hidden state (the last layer's output, normalized)."""
    arch = head_arch(target.config)
    embed, lm = target_tables(target)
    head = EagleHead(
        arch, embed.float(), lm[draft_vocab].float(), draft_vocab, dtype=torch.float32, target_layers=target_layers
    )
    last = target.model.layers[-1]
    with torch.no_grad():
        for name, p in head.layer.named_parameters():
            p.copy_(dict(last.named_parameters())[name].float())
        head.norm.weight.copy_(target.model.norm.weight.float())
        h = arch.hidden_size
        g = torch.Generator().manual_seed(seed)
        head.fc.weight.copy_(torch.cat([torch.randn(h, h, generator=g) * (0.2 / math.sqrt(h)), torch.eye(h)], dim=1))
        if head.fuse is not None and head.fuse_norm is not None:
            last_layer = target.config.num_hidden_layers - 1
            if last_layer not in target_layers:
                raise ValueError(f"a multi-layer head's target_layers must include the last layer ({last_layer})")
            blocks = [torch.eye(h) if i == last_layer else torch.zeros(h, h) for i in target_layers]
            head.fuse.weight.copy_(torch.cat(blocks, dim=1))
            head.fuse_norm.weight.copy_(target.model.norm.weight.float())
    return head


def train_head(
    head: EagleHead,
    sequences: list[list[int]],
    feats: list[torch.Tensor],
    argmaxes: list[torch.Tensor],
    epochs: int = 3,
    lr: float = 1e-3,
    tokens_per_batch: int = 4096,
    max_len: int = 512,
    ce_weight: float = 0.1,
    noise: float = 0.1,
    seed: int = 0,
    loss_start: list[int] | None = None,
    bf16: bool = False,
    steps: int = 1,
    log=print,
) -> dict[str, float]:
    """Train in place (parameters of fc, layer and norm). Returns the last epoch's mean losses and
    the draft-vocab top-1 accuracy on the target's argmax (teacher-forced, one step ahead).
    loss_start[s]: the first feature index of sequence s that is scored (the head only drafts
    inside answers, so `prompt_len - 1` scores answer predictions only; earlier positions still
    give attention context). bf16: autocast the forward (AVX512-BF16 CPUs train ~2x faster).
    steps > 1: also train on the head's own drafts, steps deep (`train_forward(..., steps)`); the
    losses of all steps are summed and `top1_step{s}` reports each step's accuracy.
    A multi-layer head (`head.target_layers`; feats are those layers' outputs side by side) learns from the
    cross-entropy alone and without input noise (EAGLE-3's recipe): there is no one target feature to regress to,
    and unrolling (`steps`) is what teaches it to read its own outputs."""
    multi = bool(head.target_layers)
    if multi:
        noise = 0.0
    for name, p in head.named_parameters():
        p.requires_grad_(not name.startswith("head."))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    vocab = head.draft_vocab
    index_of = torch.full((head.arch.vocab_size,), -100, dtype=torch.long)
    index_of[vocab] = torch.arange(len(vocab))
    head_w = head.head.weight.detach().float()
    # Windows of at most max_len + 1 positions (each yields max_len training pairs).
    windows: list[tuple[int, int, int]] = []
    for si, s in enumerate(sequences):
        for a in range(0, len(s) - 1, max_len):
            b = min(a + max_len + 1, len(s))
            if b - a >= 2 and (loss_start is None or b - 1 > loss_start[si]):
                windows.append((si, a, b))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    feat_rms = torch.cat([f[:64].float() for f in feats[:64]]).pow(2).mean().sqrt().item()
    total_steps = epochs * max(1, sum(b - a - 1 for _, a, b in windows) // tokens_per_batch)
    step = 0
    t0 = time.perf_counter()
    stats: dict[str, float] = {}
    for ep in range(epochs):
        rng.shuffle(windows)
        batches, cur, cur_tok = [], [], 0
        for w in windows:
            cur.append(w)
            cur_tok += w[2] - w[1] - 1
            if cur_tok >= tokens_per_batch:
                batches.append(cur)
                cur, cur_tok = [], 0
        if cur:
            batches.append(cur)
        sums = {"l1": 0.0, "ce": 0.0, "acc": 0.0, "n": 0.0} | {f"acc{k}": 0.0 for k in range(1, steps + 1)}
        for bi, batch in enumerate(batches):
            T = max(b - a - 1 for _, a, b in batch)
            B = len(batch)
            H = head.arch.hidden_size
            ids = torch.zeros(B, T, dtype=torch.long)
            fin = torch.zeros(B, T, feats[0].shape[-1])
            fout = torch.zeros(B, T, H if not multi else 0)
            labels = torch.full((B, T), -100, dtype=torch.long)
            mask = torch.zeros(B, T, dtype=torch.bool)
            for j, (si, a, b) in enumerate(batch):
                n = b - a - 1
                ids[j, :n] = torch.tensor(sequences[si][a + 1 : b])
                fin[j, :n] = feats[si][a : b - 1].float()
                if not multi:
                    fout[j, :n] = feats[si][a + 1 : b].float()
                labels[j, :n] = index_of[argmaxes[si][a + 1 : b].long()]
                first = 0 if loss_start is None else max(0, loss_start[si] - a)
                mask[j, first:n] = True
            fin = fin + torch.randn(fin.shape, generator=gen) * (noise * feat_rms)
            lr_now = lr * 0.5 * (1 + math.cos(math.pi * step / max(1, total_steps)))
            for g in opt.param_groups:
                g["lr"] = lr_now
            if not mask.any():
                continue
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                preds = train_forward(head, ids, fin, steps)
                preds = [preds] if steps == 1 else preds
            l1 = ce = torch.zeros(())
            step_acc = []
            for k, pred in enumerate(preds):  # step k + 1 drafts from position j - k: scored if that one is
                mk = torch.zeros_like(mask)
                mk[:, k:] = mask[:, : T - k]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    picked = pred[mk]
                    logits = F.linear(picked, head_w).float()
                if not multi:
                    l1 = l1 + F.smooth_l1_loss(picked.float(), fout[mk]) / feat_rms
                lab = labels[mk]
                ce = ce + F.cross_entropy(logits, lab, ignore_index=-100)
                with torch.no_grad():
                    valid = lab >= 0
                    step_acc.append(
                        (logits.argmax(-1)[valid] == lab[valid]).float().mean().item() if valid.any() else 0.0
                    )
            loss = l1 + ce_weight * ce if not multi else ce
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            acc = step_acc[0]
            sums["l1"] += l1.item()
            sums["ce"] += ce.item()
            sums["acc"] += acc
            sums["n"] += 1
            for k, a in enumerate(step_acc):
                sums[f"acc{k + 1}"] += a
            if (bi + 1) % 20 == 0 or bi + 1 == len(batches):
                n = sums["n"]
                log(
                    f"epoch {ep + 1}/{epochs} batch {bi + 1}/{len(batches)}: smooth-l1 {sums['l1'] / n:.4f} "
                    f"ce {sums['ce'] / n:.3f} top-1 {sums['acc'] / n:.3f}"
                    + ("".join(f"/{sums[f'acc{k}'] / n:.3f}" for k in range(2, steps + 1)))
                    + f" lr {lr_now:.2e} "
                    f"{time.perf_counter() - t0:.0f} s"
                )
        n = max(1.0, sums["n"])
        stats = {"smooth_l1": sums["l1"] / n, "ce": sums["ce"] / n, "top1": sums["acc"] / n}
        if steps > 1:
            stats |= {f"top1_step{k}": sums[f"acc{k}"] / n for k in range(1, steps + 1)}
    for p in head.parameters():
        p.requires_grad_(False)
    return stats


@torch.no_grad()
def chain_acceptance(
    head: EagleHead,
    sequences: list[list[int]],
    feats: list[torch.Tensor],
    argmaxes: list[torch.Tensor],
    loss_start: list[int],
    depth: int = 5,
    max_len: int = 512,
) -> dict[str, float]:
    """Greedy chain acceptance of `head` on a corpus, as drafting at serving time sees it: from every
    answer position a, the head drafts `depth` tokens from the target's features up to a and its own
    after (`train_forward(..., depth)`), and the target's argmax accepts the longest matching prefix.
    Returns the mean accepted drafts per step ("accepted"), and "alpha{k}": the share of steps whose
    k-th draft was accepted given the first k - 1 were. (Greedy targets: a draft is accepted iff it is
    the target's argmax, the same rule the engine's greedy verifier applies.)"""
    vocab = head.draft_vocab
    head_w = head.head.weight.float()
    accepted = torch.zeros(depth + 1)
    for si, s in enumerate(sequences):
        for a0 in range(0, len(s) - 1, max_len):
            b = min(a0 + max_len + 1, len(s))
            n = b - a0 - 1
            ids = torch.tensor(s[a0 + 1 : b])[None]
            outs = train_forward(head, ids, feats[si][a0 : b - 1].float()[None], depth)
            labels = argmaxes[si][a0 + 1 : b].long()
            # ok[k, a]: the (k+1)-th draft from start a (position a + k) is the target's argmax there
            ok = torch.zeros(depth, n, dtype=torch.bool)
            for k, o in enumerate(outs):
                hit = vocab[F.linear(o[0].float(), head_w).argmax(-1)] == labels
                ok[k, : n - k] = hit[k:]
            run = torch.cumprod(ok.int(), dim=0)  # drafts 1..k all accepted
            first = max(0, loss_start[si] - a0)
            starts = torch.arange(n)
            keep = (starts >= first) & (starts + depth <= n)  # whole chain inside the window
            accepted += torch.bincount(run[:, keep].sum(0), minlength=depth + 1).float()
    total = accepted.sum().item()
    out = {"accepted": float((accepted * torch.arange(depth + 1)).sum() / max(total, 1.0)), "starts": total}
    reach = accepted.flip(0).cumsum(0).flip(0)  # reach[k]: starts with >= k accepted
    for k in range(1, depth + 1):
        out[f"alpha{k}"] = float(reach[k] / max(reach[k - 1].item(), 1.0))
    return out


def main(
    model: str,
    out: str,
    sharegpt: str,
    num_prompts: int = 3300,
    max_tokens: int = 192,
    draft_vocab_size: int = 8192,
    epochs: int = 8,
    lr: float = 2e-3,
    threads: int | None = None,
    cache: str | None = None,
    init: str | None = None,
    answers_only: bool = True,
    bf16: bool = True,
    datastore: str | None = None,
    unroll: int = 1,
    eval_prompts: int = 0,
    eval_depth: int = 5,
    feature_layers: tuple[int, ...] = (),
) -> dict[str, float]:
    """The whole recipe; `cache` keeps the corpus and features between runs (a .pt file); `init`
    continues training a head saved before (its draft vocabulary is kept); `unroll` trains on the
    head's own drafts that deep; `eval_prompts` > 0 measures greedy chain acceptance (`chain_acceptance`)
    before and after training on that many held-out prompts: the benchmark's rows, never trained on.
    `feature_layers`: a multi-layer head reading those target layers' outputs (EAGLE-3's features); the cache
    then holds those layers' outputs."""
    from tokenmill import LLM
    from tokenmill.spec_decode.eagle_head import load_eagle_head

    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", enable_prefix_caching=False)
    target = llm.engine.model
    if cache and Path(cache).is_file():
        data = torch.load(cache)
        seqs, feats, argmaxes, plens = data["sequences"], data["features"], data["argmaxes"], data["prompt_lens"]
        print(f"loaded corpus and features from {cache}")
    else:
        corpus = (
            corpus_from_datastore(datastore, llm.tokenizer, sharegpt)
            if datastore
            else generate_corpus(llm, sharegpt, num_prompts, max_tokens)
        )
        seqs, plens = corpus.sequences, corpus.prompt_lens
        feats, argmaxes = extract_features(target, seqs, feature_layers)
        if cache:
            torch.save({"sequences": seqs, "features": feats, "argmaxes": argmaxes, "prompt_lens": plens}, cache)
    t_data = time.perf_counter() - t0
    if init:
        embed, lm = target_tables(target)
        head = load_eagle_head(init, target.config, embed.float(), lm.float(), torch.float32)
        vocab = head.draft_vocab
    else:
        vocab = choose_draft_vocab(argmaxes, target.config.vocab_size, draft_vocab_size)
        head = init_head_from_target(dense_target(model), vocab, target_layers=feature_layers)
    covered = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    covered[vocab] = True
    coverage = covered[torch.cat(argmaxes).long()].float().mean().item()
    print(f"draft vocab {len(vocab)}: covers {coverage:.4f} of the target's argmax tokens")
    held = None
    if eval_prompts:
        ev = generate_corpus(llm, sharegpt, eval_prompts, max_tokens, skip_rows=0)
        ev_feats, ev_arg = extract_features(target, ev.sequences, feature_layers)
        held = (ev.sequences, ev_feats, ev_arg, [p - 1 for p in ev.prompt_lens])
        before = chain_acceptance(head, *held, depth=eval_depth)
        print(f"held-out chain acceptance before training: {json.dumps(before)}")
    starts = [p - 1 for p in plens] if answers_only else None
    stats = train_head(
        head, seqs, feats, argmaxes, epochs=epochs, lr=lr, ce_weight=0.2, loss_start=starts, bf16=bf16, steps=unroll
    )
    head.save(out, model)
    if held is not None:
        after = chain_acceptance(head, *held, depth=eval_depth)
        print(f"held-out chain acceptance after training: {json.dumps(after)}")
        stats.update({f"heldout_before_{k}": v for k, v in before.items()})
        stats.update({f"heldout_after_{k}": v for k, v in after.items()})
    stats.update(
        coverage=coverage,
        data_seconds=t_data,
        total_seconds=time.perf_counter() - t0,
        tokens=float(sum(len(s) for s in seqs)),
    )
    (Path(out) / "train_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats))
    return stats


# ------------------------------------------------------------------------------------ CLI
def add_corpus_arguments(p) -> None:
    """The corpus options shared with `tokenmill build-datastore`: the target, the ShareGPT file, how
    many prompts it answers and how long, and torch threads."""
    default_data = Path(__file__).resolve().parents[3] / "shared" / "data" / "sharegpt_v3_first_exchange_5000.jsonl"
    p.add_argument("--model", default="smollm2-135m", help="target model (path or alias)")
    p.add_argument("--sharegpt", default=str(default_data), help="ShareGPT jsonl (first human turns)")
    p.add_argument("--num-prompts", type=int, default=3300, help="prompts the target answers for the corpus")
    p.add_argument("--max-tokens", type=int, default=192, help="answer length cap per prompt")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def add_arguments(p) -> None:
    add_corpus_arguments(p)
    p.add_argument("--out", required=True, help="directory for the head (eagle_config.json, model.safetensors)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="rows of the head's LM head (most frequent tokens)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--init", default=None, help="continue training this head directory")
    p.add_argument("--all-positions", action="store_true", help="score prompt positions too (default: answers only)")
    p.add_argument("--fp32", action="store_true", help="train in float32 (default: bf16 autocast)")
    p.add_argument("--cache", default=None, help="a .pt file keeping corpus and features between runs")
    p.add_argument(
        "--unroll",
        type=int,
        default=1,
        help="also train on the head's own drafts this many steps deep (EAGLE-3's training-time test)",
    )
    p.add_argument(
        "--eval-prompts",
        type=int,
        default=0,
        help="held-out prompts (the benchmark's rows) on which greedy chain acceptance is measured "
        "before and after training",
    )
    p.add_argument(
        "--datastore",
        default=None,
        help="reuse the answers of a `tokenmill build-datastore` file instead of generating a corpus",
    )
    p.add_argument(
        "--feature-layers",
        default="",
        help="a multi-layer head (EAGLE-3's features): target layers whose outputs it reads, comma separated "
        "(e.g. 1,15,29; the last layer must be among them); empty: the final hidden state",
    )


def run(args) -> int:
    if not Path(args.sharegpt).is_file():
        raise ValueError(f"{args.sharegpt}: ShareGPT file not found (pass --sharegpt)")
    main(
        args.model,
        args.out,
        args.sharegpt,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        draft_vocab_size=args.draft_vocab,
        epochs=args.epochs,
        lr=args.lr,
        threads=args.threads,
        cache=args.cache,
        init=args.init,
        answers_only=not args.all_positions,
        bf16=not args.fp32,
        datastore=args.datastore,
        unroll=args.unroll,
        eval_prompts=args.eval_prompts,
        feature_layers=tuple(int(x) for x in args.feature_layers.split(",") if x.strip()),
    )
    return 0
