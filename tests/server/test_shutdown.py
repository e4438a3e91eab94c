"""SIGTERM: the server stops accepting, lets short requests finish, aborts what outlives the
grace period, and exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, start_server

pytestmark = pytest.mark.slow


def _stream(server, max_tokens: int, out: dict, first_chunk: threading.Event) -> None:
    body = {
        "model": MODEL,
        "prompt": "Tell me a story.",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    out["chunks"], out["done"], out["error"] = [], False, None
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                out["chunks"].append(json.loads(line[6:]))
                first_chunk.set()
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    finally:
        first_chunk.set()


LONG = 4000
"""The long request's tokens: far more than the 4 s grace lets any host decode (the native GGUF kernels decode
the default model at ~200 tok/s on 2 cores; 480 tokens once fit in the grace)."""


def test_sigterm_drains_then_aborts_and_exits_zero(tmp_path):
    server = start_server(
        tmp_path,
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "4",
        "--kv-cache-memory-bytes",
        str(256 << 20),
        "--shutdown-timeout",
        "4",
    )
    try:
        short, long_ = {}, {}
        got_short, got_long = threading.Event(), threading.Event()
        threads = [
            threading.Thread(target=_stream, args=(server, 12, short, got_short)),
            threading.Thread(target=_stream, args=(server, LONG, long_, got_long)),
        ]
        for t in threads:
            t.start()
        assert got_short.wait(120) and got_long.wait(120)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/health", timeout=2)
        rc = server.proc.wait(60)
        for t in threads:
            t.join(30)
    finally:
        server.stop(signal.SIGKILL)
    assert rc == 0, server.log()
    # The short request finished normally within the grace period...
    assert short["done"], short
    finishes = [c["choices"][0]["finish_reason"] for c in short["chunks"] if c["choices"]]
    assert finishes[-1] == "length"
    # ... the long one was aborted when the grace period ran out: an error event, then [DONE].
    assert long_["done"], long_
    assert "error" in long_["chunks"][-1] and "shutting down" in long_["chunks"][-1]["error"]["message"]
    assert all(c["choices"][0]["finish_reason"] is None for c in long_["chunks"][:-1] if c.get("choices"))
    # ... cut short: the server exited without waiting for all its tokens
    assert sum(1 for c in long_["chunks"] if c.get("choices")) < LONG  # one chunk per token at most
    assert "Application shutdown complete" in server.log()


def test_model_load_failure_exits_nonzero(tmp_path):
    """A model that cannot load: /health says why (503) while the server winds down, and it exits 1."""
    import subprocess
    import sys

    from tests.server.conftest import REPO, free_port

    port = free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.entrypoints.cli",
            "serve",
            "--port",
            str(port),
            "--model",
            str(tmp_path / "no-such-model.gguf"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no-such-model.gguf" in proc.stdout + proc.stderr
