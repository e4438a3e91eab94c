"""`tokenmill bench suite`: the headline benchmarks on this machine, one record per CPU kind (issue 47).

    tokenmill bench suite                         # every entry of suite_entries.ENTRY_NAMES
    tokenmill bench suite --only decode_bf16,roofline   # or --skip serve_vs_vllm
    tokenmill bench suite --dry-run               # the plan: each command and its estimated time, nothing run
    tokenmill bench suite --write-readme          # README.md's table from benchmarks/results/*.json, nothing run

It writes benchmarks/results/<cpu-kind>.json, the kind named from the kernels' ISA level and the CPU's model name
(cpu_kind: e.g. avx512-bf16-amd-epyc). The record holds the date, the commit, the host (ISA, model name, cores,
threads, the read bandwidth the roofline entry measured) and per entry the exact commands, the figures kept from
their output, and a status: ok, absent (a peer cannot run here; the reason) or failed (the error).

The suite measures nothing itself. Each step of an entry runs in a fresh process (`python -m
tokenmill.entrypoints.cli ...`, the existing bench subcommands, `tokenmill quantize` and `tokenmill eval`) with its
output and logs in --work-dir, so one entry's threads, caches and allocations never reach the next. The record is
written after every entry; a rerun skips the entries already ok at the same commit (--force reruns them), so an
interrupted run resumes. --quick shrinks every entry to a few tokens and prompts (a test of the plumbing) and
writes under --work-dir, never into benchmarks/results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tokenmill.bench.common import REPO_ROOT
from tokenmill.bench.suite_entries import (
    ENTRY_NAMES,
    Entry,
    Outcome,
    Step,
    SuiteOptions,
    headline_entries,
    slugify,
)

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
"""Where the records live, one JSON file per CPU kind; README.md's table is generated from them."""
SCHEMA = 1
BUILT_AT = ".suite-commit"
"""In a preparation's output directory: the commit it was built at (reused at the same commit only)."""
NAME_NOISE = re.compile(r"\((r|tm)\)|@.*$|\bcpu\b|\bprocessor\b|\b\d+-core\b", re.IGNORECASE)
"""What a CPU model name carries beyond the part: trademarks, the clock, the words CPU/Processor, core counts."""

Runner = Callable[[Step], dict]
"""Runs one step and returns its output (raises StepFailed)."""


class StepFailed(RuntimeError):
    """A step exited non-zero, timed out, or wrote no output."""


# ---------------------------------------------------------------------------------------------- the host
def cpu_model_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name: /proc/cpuinfo's `model name` (what lscpu prints as Model name), else the
    platform's processor string, else "unknown-cpu"."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "model name" and value.strip():
            return value.strip()
    import platform

    return platform.processor() or "unknown-cpu"


def cpu_kind(isa: str, model_name: str) -> str:
    """The record's name: the kernels' ISA level then the CPU part, slugified. ("avx512_bf16", "AMD EPYC") ->
    avx512-bf16-amd-epyc; ("amx", "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz") ->
    amx-intel-xeon-platinum-8481c; ("avx2", "AMD EPYC 7B13 64-Core Processor") -> avx2-amd-epyc-7b13."""
    part = slugify(NAME_NOISE.sub(" ", model_name)) or "unknown-cpu"
    return f"{slugify(isa) or 'unknown-isa'}-{part}"


def host_facts(num_threads: int) -> dict:
    from tokenmill import native

    return {
        "isa": native.isa(),
        "model_name": cpu_model_name(),
        "cores": os.cpu_count(),
        "threads": num_threads,
        "python": sys.version.split()[0],
    }


def git_state() -> tuple[str, bool]:
    """(HEAD's commit, whether tracked files differ from it); ("unknown", True) outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
        diff = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True
    return head.stdout.strip(), bool(diff.stdout.strip())


# ---------------------------------------------------------------------------------------------- the record
def load_record(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def save_record(path: Path, record: dict) -> None:
    """Written whole to a temporary file, then renamed over the old one (an interrupted write loses nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)


def is_done(prev: dict | None, commit: str) -> bool:
    """An entry a rerun skips: ok, measured at this commit."""
    return prev is not None and prev.get("status") == "ok" and prev.get("commit") == commit


def _clock_text(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def run_suite(
    entries: list[Entry],
    record: dict,
    *,
    commit: str,
    dirty: bool,
    runner: Runner,
    force: bool = False,
    save: Callable[[dict], None] | None = None,
    echo: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
) -> dict:
    """Run each entry's steps with `runner`, summarize them, and keep the outcome in record["entries"], saving the
    record after every entry. An entry already ok at `commit` is skipped unless `force`. A step that fails, or a
    summary that finds a figure missing, makes the entry failed (with the error) and the suite goes on."""
    start = clock()
    entries_out = record.setdefault("entries", {})
    for i, entry in enumerate(entries, 1):
        head = f"[{i}/{len(entries)}] {entry.name}"
        if not force and is_done(entries_out.get(entry.name), commit):
            echo(f"{head}: ok at {commit[:10]} already, skipped (--force reruns it)")
            continue
        echo(f"{head}: {entry.what} (~{_clock_text(entry.est_s)} at full size; {_clock_text(clock() - start)} elapsed)")
        t0 = clock()
        try:
            outputs = {}
            for j, step in enumerate(entry.steps, 1):
                echo(f"    step {j}/{len(entry.steps)}: {step.command}")
                outputs[step.name] = runner(step)
            outcome = entry.summarize(outputs)
        except StepFailed as e:
            outcome = Outcome("failed", {}, str(e))
        except Exception as e:  # a figure missing from a step's output: the entry failed, the suite goes on
            outcome = Outcome("failed", {}, f"summary: {type(e).__name__}: {e}")
        result: dict = {"what": entry.what, "status": outcome.status}
        if outcome.reason:
            result["reason"] = outcome.reason
        result.update(
            figures=outcome.figures,
            commands=[s.command for s in entry.steps],
            commit=commit,
            dirty=dirty,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            elapsed_s=round(clock() - t0, 1),
        )
        entries_out[entry.name] = result
        roofline = entries_out.get("roofline", {})
        if roofline.get("status") == "ok":
            record.setdefault("host", {})["read_gb_s"] = roofline["figures"]["read_gb_s"]
        if save is not None:
            save(record)
        tail = f": {outcome.reason}" if outcome.reason else ""
        echo(f"{head}: {outcome.status} in {_clock_text(clock() - t0)}{tail}")
    echo(f"suite: {len(entries)} entries in {_clock_text(clock() - start)}")
    return record


class SubprocessRunner:
    """Runs a step as `python -m tokenmill.entrypoints.cli ...` in a fresh process (its own session, killed whole
    on a timeout), from the repository root, with stdout and stderr kept in work_dir/steps/NNN-name/ (a relative
    work_dir, like every relative path of a step, is relative to the repository root)."""

    def __init__(self, work_dir: Path, commit: str, timeout_s: float = 3600.0) -> None:
        self.work_dir = work_dir
        self.commit = commit
        self.timeout_s = timeout_s
        self._num_steps = 0

    def __call__(self, step: Step) -> dict:
        creates = REPO_ROOT / step.creates if step.creates else None  # relative paths: to the repository root
        built = creates / BUILT_AT if creates else None
        if built is not None and built.is_file() and built.read_text().strip() == self.commit:
            print(f"    reusing {step.creates} (built at this commit)")
            return {"reused": step.creates}
        if creates is not None:
            shutil.rmtree(creates, ignore_errors=True)
        self._num_steps += 1
        d = REPO_ROOT / self.work_dir / "steps" / f"{self._num_steps:03d}-{slugify(step.name)}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        argv = list(step.argv)
        if step.output == "json":
            argv += ["--output-json", str(d / "out.json")]
        elif step.output == "serve":
            argv += ["--result-dir", str(d)]
        with open(d / "stdout.txt", "w") as out, open(d / "stderr.txt", "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tokenmill.entrypoints.cli", *argv],
                stdout=out,
                stderr=err,
                cwd=REPO_ROOT,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                raise StepFailed(f"timed out after {self.timeout_s:.0f} s (logs: {d})") from None
        if rc != 0:
            lines = [x for x in (d / "stderr.txt").read_text(errors="replace").splitlines() if x.strip()]
            raise StepFailed(f"exit {rc}: {' | '.join(lines[-3:])[-600:]} (logs: {d})")
        if built is not None:
            built.write_text(self.commit)
        return self._output(step, d)

    @staticmethod
    def _output(step: Step, d: Path) -> dict:
        if step.output == "none":
            return {}
        if step.output == "stdout":
            for line in reversed((d / "stdout.txt").read_text().splitlines()):
                if line.startswith("{"):
                    return json.loads(line)
            raise StepFailed(f"no JSON line on stdout (logs: {d})")
        path = d / ("out.json" if step.output == "json" else "serve.json")
        if not path.is_file():
            raise StepFailed(f"no output {path}")
        return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------- CLI
def select_entries(only: str | None, skip: str | None) -> list[str]:
    """Entry names to run, in the suite's order: --only's (default all) minus --skip's."""

    def names(text: str | None) -> list[str]:
        out = [x.strip() for x in (text or "").split(",") if x.strip()]
        bad = [x for x in out if x not in ENTRY_NAMES]
        if bad:
            raise ValueError(f"unknown suite entries {bad}; entries: {', '.join(ENTRY_NAMES)}")
        return out

    wanted, dropped = set(names(only) or ENTRY_NAMES), set(names(skip))
    return [n for n in ENTRY_NAMES if n in wanted and n not in dropped]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("suite")
    g.add_argument(
        "--only", default=None, help=f"Comma list of entries to run (default: all of {', '.join(ENTRY_NAMES)})"
    )
    g.add_argument("--skip", default=None, help="Comma list of entries to leave out")
    g.add_argument("--force", action="store_true", help="Rerun entries already ok at this commit")
    g.add_argument("--quick", action="store_true", help="A few tokens and prompts per entry (a test; no record)")
    g.add_argument("--dry-run", action="store_true", help="Print each entry's commands and estimated time only")
    g.add_argument(
        "--write-readme",
        action="store_true",
        help="Regenerate README.md's benchmark table from benchmarks/results/*.json and exit (nothing run)",
    )
    g.add_argument("--model", default="smollm2-135m", help="Model of every entry (default: smollm2-135m)")
    g.add_argument("--num-threads", type=int, default=None, help="Threads of every entry (default: all cores)")
    g.add_argument("--engine-args", default="", help="Extra engine flags for every command taking them (one string)")
    g.add_argument("--results-dir", default=None, help="Where the record goes (default: benchmarks/results)")
    g.add_argument("--work-dir", default="bench_out/suite", help="Quantized checkpoints, step outputs and logs")
    g.add_argument("--step-timeout", type=float, default=3600.0, help="Seconds before a step is killed")
    g = p.add_argument_group("peers and artefacts")
    g.add_argument("--datastore", default=None, help="speculation: an n-gram datastore (tokenmill build-datastore)")
    g.add_argument("--eagle", default=None, help="speculation: an EAGLE head directory (tokenmill train-eagle)")
    g.add_argument("--medusa", default=None, help="speculation: Medusa heads (tokenmill train-medusa)")
    g.add_argument("--vllm-venv", default=None, help="vLLM's virtualenv (default: ../peers/vllm)")
    g.add_argument("--vllm-model", default=None, help="The model as an HF directory for vLLM (default: ../peers/...)")
    g.add_argument("--vllm-dtypes", default="bfloat16,float32", help="vLLM dtypes to try (default: bfloat16,float32)")
    g.add_argument(
        "--vllm-bindings", default="all-cores,default", help="vLLM thread bindings to try (default: all-cores,default)"
    )
    g.add_argument(
        "--serve-client",
        choices=["auto", "vllm", "tokenmill"],
        default="auto",
        help="Client of the serving loads: vLLM's own bench serve where vLLM runs (auto), or ours",
    )
    g.add_argument("--ppl-windows", type=int, default=8, help="perplexity: WikiText-2 windows (default: 8)")


def _vllm_reason(args: argparse.Namespace) -> str | None:
    from tokenmill.bench.vllm_peer import vllm_available

    if args.model != "smollm2-135m" and not args.vllm_model:
        return f"vLLM serves the default model's HF directory; pass --vllm-model DIR for {args.model}"
    return vllm_available(args.vllm_venv, args.vllm_model)


def run(args: argparse.Namespace) -> int:
    from tokenmill.bench.suite_readme import write_readme

    if args.write_readme:
        print(f"wrote {write_readme(RESULTS_DIR)}")
        return 0
    names = select_entries(args.only, args.skip)
    threads = args.num_threads or os.cpu_count() or 1
    work_dir = Path(args.work_dir)  # relative: to the repository root, where every step runs
    opts = SuiteOptions(
        model=args.model,
        num_threads=threads,
        quick=args.quick,
        work_dir=work_dir,
        engine_args=tuple(args.engine_args.split()),
        datastore=args.datastore,
        eagle=args.eagle,
        medusa=args.medusa,
        vllm_reason=_vllm_reason(args) if "serve_vs_vllm" in names else None,
        vllm_venv=args.vllm_venv,
        vllm_model=args.vllm_model,
        vllm_dtypes=tuple(x for x in args.vllm_dtypes.split(",") if x),
        vllm_bindings=tuple(x for x in args.vllm_bindings.split(",") if x),
        serve_client=args.serve_client,
        ppl_windows=args.ppl_windows,
    )
    entries = [e for e in headline_entries(opts) if e.name in names]
    print(f"{len(entries)} entries, ~{sum(e.est_s for e in entries) / 60:.0f} min at full size on 2 cores (estimated)")
    if args.dry_run:
        for e in entries:
            print(f"{e.name} (~{_clock_text(e.est_s)}): {e.what}")
            for s in e.steps:
                print(f"    {s.command}")
        return 0
    host = host_facts(threads)
    kind = cpu_kind(host["isa"], host["model_name"])
    results = REPO_ROOT / work_dir / "quick" if args.quick else RESULTS_DIR  # a quick run is never a record
    path = (Path(args.results_dir) if args.results_dir else results) / f"{kind}.json"
    commit, dirty = git_state()
    record = load_record(path) or {"schema": SCHEMA, "cpu_kind": kind, "entries": {}}
    record.update(
        cpu_kind=kind,
        host={**record.get("host", {}), **host},
        model=args.model,
        quick=args.quick,
        date=time.strftime("%Y-%m-%d", time.gmtime()),
        commit=commit,
        dirty=dirty,
    )
    print(f"record: {path} (CPU kind {kind}, commit {commit[:10]}{' with uncommitted changes' if dirty else ''})")
    run_suite(
        entries,
        record,
        commit=commit,
        dirty=dirty,
        runner=SubprocessRunner(work_dir, commit, args.step_timeout),
        force=args.force,
        save=lambda r: save_record(path, r),
    )
    for name in names:
        e = record["entries"].get(name, {})
        print(f"  {name}: {e.get('status', 'not run')}{': ' + e['reason'] if e.get('reason') else ''}")
    print(f"wrote {path}; README.md's table: tokenmill bench suite --write-readme (after committing the record)")
    return 0
