"""`tokenmill <command>`: each command lives in its own module exposing add_arguments(parser)
and run(args); modules are imported only when their command runs."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tokenmill.entrypoints.cli_generate", "Generate a completion, streamed to the terminal."),
    "chat": ("tokenmill.entrypoints.cli_chat", "Interactive chat with the model's chat template."),
    "serve": ("tokenmill.entrypoints.openai.cli", "OpenAI-compatible HTTP server."),
    "router": ("tokenmill.entrypoints.router", "OpenAI-compatible front for prefill/decode disaggregated workers."),
    "quantize": ("tokenmill.entrypoints.cli_quantize", "Quantize a model with RTN, GPTQ or AWQ."),
    "eval": ("tokenmill.eval.cli", "Evaluate a model (perplexity)."),
    "train-eagle": ("tokenmill.training.eagle", "Train an EAGLE draft head for speculative decoding."),
    "train-medusa": ("tokenmill.training.medusa", "Train Medusa heads for token-tree speculative decoding."),
    "train-drafter": ("tokenmill.training.block_drafter", "Train a block (DFlash-style) drafter for speculation."),
    "build-datastore": (
        "tokenmill.training.datastore",
        "Build the n-gram proposer's datastore from the target's own answers.",
    ),
    "bench": ("tokenmill.bench.cli", "Benchmarks: latency, throughput, serve, roofline, ablation, suite."),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill: LLM inference engine and server")
    sub = parser.add_subparsers(dest="command", metavar="command")
    mods = {}
    want = argv[0] if argv and not argv[0].startswith("-") else None
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == want:
            try:
                mods[name] = importlib.import_module(module)
            except ModuleNotFoundError as e:
                if e.name and module.startswith(e.name):
                    print(f"tokenmill {name}: not available in this build ({e})", file=sys.stderr)
                    return 2
                raise
            mods[name].add_arguments(p)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return mods[args.command].run(args) or 0
    except KeyboardInterrupt:
        return 130
    except ValueError as e:  # configuration and input errors: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
