"""`tokenmill chat`: an interactive chat; /reset clears the history, /exit or Ctrl-D quits."""

from __future__ import annotations

import argparse
import sys

from tokenmill.entrypoints.cli_generate import add_sampling_args, sampling_from_args, stream
from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="System prompt.")
    add_sampling_args(p)
    p.set_defaults(max_tokens=256)
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    from tokenmill.engine.core import EngineCore

    params = sampling_from_args(args)
    engine = EngineCore(engine_config_from_args(args))
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        text = engine.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        reply = stream(engine, engine.tokenizer.encode(text, add_special_tokens=False), params)
        print()
        history.append({"role": "assistant", "content": reply})
    return 0
