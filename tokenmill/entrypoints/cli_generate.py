"""`tokenmill generate "prompt"`: streams the completion to the terminal."""

from __future__ import annotations

import argparse
import sys

from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=None, help="Per-request sampling seed.")
    p.add_argument("--stop", action="append", default=[], help="Stop string (repeatable).")


def sampling_from_args(args: argparse.Namespace):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sample_seed,
        stop=args.stop,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="Prompt text ('-' reads standard input).")
    p.add_argument("--chat-template", action="store_true", help="Wrap the prompt as a user message.")
    add_sampling_args(p)
    add_engine_args(p)


def stream(engine, token_ids: list[int], params, out=sys.stdout) -> str:
    """Run one request to completion, printing text as it arrives; returns the full text."""
    rid = "cli"
    engine.add_request(rid, token_ids, params)
    printed = 0
    text = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            text = o.outputs[0].text
            out.write(text[printed:])
            out.flush()
            printed = len(text)
    return text


def run(args: argparse.Namespace) -> int:
    from tokenmill.engine.core import EngineCore

    params = sampling_from_args(args)
    engine = EngineCore(engine_config_from_args(args))
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat_template:
        ids = engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False
        )
    else:
        ids = engine.tokenizer.encode(prompt)
    stream(engine, ids, params)
    print()
    return 0
