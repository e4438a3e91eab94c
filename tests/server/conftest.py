"""Start the real `tokenmill serve` as a subprocess on 127.0.0.1 (a free port) for the server tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tokenmill.bench.serve import metric_values  # noqa: F401 - the server tests import it from here
from tokenmill.engine.stats import EngineStats

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
API_KEY = "tm-test-key"
MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    api_key: str | None
    log_path: Path
    saw_503_while_loading: dict | None = None
    """The error body /v1/models answered while the model loaded (None if it loaded first)."""
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    tmp_path: Path,
    *args: str,
    api_key: str | None = API_KEY,
    load_timeout: float = 240.0,
    threads: int | None = 1,
    port: int | None = None,
) -> ServerProcess:
    """threads: torch threads of the server. NOTE: 1 by default: on a shared 2-core machine, OpenMP
    threads oversubscribed by other processes made engine steps ~15x slower. port: a given one (a restart)."""
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.entrypoints.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        MODEL,
        "--log-stats-interval",
        "5",
        *args,
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ)
    if threads:
        env["TOKENMILL_NUM_THREADS"] = str(threads)
    log_path = tmp_path / f"server-{port}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = ServerProcess(proc, port, api_key, log_path)
    deadline = time.monotonic() + load_timeout
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
            try:
                r = client.get(f"{server.url}/health")
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            if r.status_code == 200:
                return server
            if r.status_code == 503 and server.saw_503_while_loading is None:
                m = client.get(f"{server.url}/v1/models", headers=server.headers)
                server.saw_503_while_loading = {"status": m.status_code, "body": m.json()}
            time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not become healthy in {load_timeout} s:\n{server.log()}")


# Small KV pool (~364 blocks of 16 tokens) so that the load test also exercises queueing.
DEFAULT_ARGS = (
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "32",
    "--max-num-batched-tokens",
    "512",
    "--kv-cache-memory-bytes",
    str(256 << 20),
)


@pytest.fixture(scope="package")
def server(tmp_path_factory) -> ServerProcess:
    srv = start_server(tmp_path_factory.mktemp("server"), *DEFAULT_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def fp32_server(tmp_path_factory) -> ServerProcess:
    """A server in float32 whatever the host, the file dequantized at load as transformers loads it (`--dtype auto`
    is bfloat16, and the file runs in its blocks with int8 activations), for the tests that compare with
    transformers' float32 numerics within 1e-3."""
    srv = start_server(tmp_path_factory.mktemp("fp32_server"), *DEFAULT_ARGS, "--dtype", "float32", "--gguf-dequantize")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf(real_model_path):
    """Hugging Face transformers' float32 model of the default GGUF: the server tests' numerics oracle."""
    import torch

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(real_model_path.parent), gguf_file=real_model_path.name, dtype=torch.float32
    )
    return model.eval()


def engine_stats(**fields) -> EngineStats:
    """An idle engine's EngineStats (a pool of 10 free blocks), with `fields` set: what a fake core reports."""
    idle = dict(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        num_blocks_total=10,
        num_blocks_free=10,
        num_blocks_cached_free=0,
        block_size=16,
        kv_bytes_per_token=0.0,
        num_allocated_slots=0,
        num_filled_slots=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        num_prompt_tokens=0,
        num_generation_tokens=0,
    )
    return EngineStats(**{**idle, **fields})


def load_sharegpt_prompts(n: int, max_chars: int = 240) -> list[str]:
    path = SHARED_DATA / "sharegpt_v3_first_exchange_5000.jsonl"
    if not path.is_file():
        pytest.fail(f"{path} not found: the shared data folder must sit next to the repository")
    prompts = []
    with open(path) as f:
        for line in f:
            conv = json.loads(line).get("conversations") or []
            if conv and conv[0].get("from") == "human" and conv[0].get("value", "").strip():
                prompts.append(conv[0]["value"].strip()[:max_chars])
                if len(prompts) == n:
                    break
    return prompts
