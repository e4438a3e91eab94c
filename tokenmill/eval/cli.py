"""`tokenmill eval perplexity --model M`: WikiText-2 perplexity (see eval/perplexity.py for the protocol)."""

from __future__ import annotations

import argparse
import json

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval_task", metavar="task", required=True)
    p = sub.add_parser("perplexity", help="WikiText-2 test perplexity, non-overlapping windows (GPTQ/AWQ protocol).")
    p.add_argument("--model", default="smollm2-135m", help="Model path (GGUF, HF dir, quantized dir) or alias.")
    p.add_argument(
        "--dataset",
        default=None,
        help="JSONL file with a 'text' field per row "
        "(default: ../shared/data/wikitext2_raw_test.jsonl next to the repository).",
    )
    p.add_argument("--seqlen", type=int, default=None, help="Window length (default: min(2048, model context)).")
    p.add_argument("--max-windows", type=int, default=None, help="Score only the first N windows (default: all).")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16.")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads.")
    p.add_argument(
        "--quantize-lm-head",
        default="checkpoint",
        choices=["checkpoint", "auto", "none", "int8", "int4"],
        help="The LM head to score with (quant/head.py): checkpoint (default: as the checkpoint "
        "stores it, its own quantized head if it has one), none (the fp16 table), int8 / int4 "
        "(RTN of the fp16 table at load), auto (the engine's default).",
    )
    p.add_argument("--json", action="store_true", help="Print the result as one JSON line.")


def run(args: argparse.Namespace) -> int:
    from tokenmill.config import parse_dtype
    from tokenmill.eval.perplexity import evaluate_perplexity, wikitext2_ids
    from tokenmill.models.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=parse_dtype(args.dtype), quantize_lm_head=args.quantize_lm_head)
    seqlen = args.seqlen or min(2048, loaded.config.max_position_embeddings)
    ids = wikitext2_ids(lambda s: loaded.tokenizer.encode(s, add_special_tokens=False), args.dataset)
    res = evaluate_perplexity(loaded.model, ids, seqlen, args.max_windows)
    if args.json:
        print(json.dumps({"model": args.model, "lm_head": args.quantize_lm_head, **res.__dict__}))
    else:
        print(
            f"perplexity {res.perplexity:.4f}  (mean NLL {res.mean_nll:.5f}; {res.num_windows}/{res.total_windows} "
            f"windows of {res.seqlen} tokens; {res.num_tokens} tokens in the text; {res.seconds:.1f}s)"
        )
    return 0
