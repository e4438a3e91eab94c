"""`tokenmill bench {latency,throughput,serve,roofline,ablation,suite}`; each subcommand's module is
imported only when it runs."""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS = {
    "latency": ("tokenmill.bench.latency", "Batch-1 TTFT, decode tok/s and per-token latency, with peers."),
    "throughput": ("tokenmill.bench.throughput", "Offline throughput on ShareGPT or random prompts, with peers."),
    "serve": ("tokenmill.bench.serve", "Load generator for an OpenAI-compatible endpoint (vLLM's metrics)."),
    "roofline": ("tokenmill.bench.roofline", "Memory bandwidth, the engine's linear FLOP/s and the decode bound."),
    "ablation": ("tokenmill.bench.ablation", "Each serving technique on and off on the same workload."),
    "suite": ("tokenmill.bench.suite", "The headline set, one record per CPU kind in benchmarks/results/."),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="benchmark", required=True)
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_,
            description=importlib.import_module(module).__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_bench_module=module)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(args._bench_module).run(args) or 0
