"""Schemathesis against the server's own OpenAPI schema, bounded in time: no request may get a 5xx."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.server.conftest import start_server

pytestmark = pytest.mark.slow

MAX_TIME_S = int(os.environ.get("TOKENMILL_FUZZ_SECONDS", "60"))


def test_schemathesis_no_server_errors(tmp_path):
    exe = shutil.which("schemathesis", path=os.path.dirname(sys.executable)) or shutil.which("schemathesis")
    if exe is None:
        pytest.fail("schemathesis is not installed: it is a test dependency (pip install -e '.[test]')")
    # A short context keeps fuzzed generations (n up to 128, max_tokens up to the context) quick.
    server = start_server(
        tmp_path, "--max-model-len", "96", "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(64 << 20)
    )
    try:
        cmd = [
            exe,
            "run",
            f"{server.url}/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-time",
            str(MAX_TIME_S),
            "--request-timeout",
            "120",
            "--workers",
            "1",
            "--generation-database",
            "none",
            "--seed",
            "1",
            "--no-color",
            "--suppress-health-check",
            "all",
            "-H",
            f"Authorization: Bearer {server.api_key}",
            "--report",
            "junit",
            "--report-junit-path",
            str(tmp_path / "junit.xml"),
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=MAX_TIME_S + 300, cwd=tmp_path)
        report = run.stdout[-6000:] + run.stderr[-2000:]
        assert run.returncode == 0, report
        assert "Server error" not in report, report
        # The server survived and still serves, and nothing leaked.
        r = httpx.post(
            f"{server.url}/v1/completions",
            headers=server.headers,
            timeout=120,
            json={"prompt": "Hello", "max_tokens": 2},
        )
        assert r.status_code == 200
        kv = httpx.get(f"{server.url}/debug/kv_cache", headers=server.headers).json()
        assert kv["num_blocks_free"] == kv["num_blocks_total"] and kv["integrity"] == "ok", kv
        assert "unhandled error" not in server.log(), server.log()[-5000:]
    finally:
        server.stop()
    print("\n" + report[-1500:])
