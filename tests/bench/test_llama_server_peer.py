"""The llama-server peer: where the binary is looked up and why it is reported absent (nothing is
started), its command line, and, when a llama-server binary is around, a real 2-slot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.bench import peers
from tokenmill.bench.common import SampleRequest


def fake_binary(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / "llama-server"
    p.write_text("#!/bin/sh\nexit 1\n")
    p.chmod(0o755)
    return p


@pytest.fixture
def no_server(monkeypatch, tmp_path):
    """No llama-server anywhere: no variable, nothing at the default location, an empty PATH."""
    monkeypatch.delenv(peers.LLAMA_SERVER_ENV, raising=False)
    monkeypatch.setattr(peers, "DEFAULT_LLAMA_SERVER", tmp_path / "missing" / "llama-server")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))


def test_lookup_order(no_server, monkeypatch, tmp_path):
    assert peers.find_llama_server() is None
    on_path = fake_binary(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert peers.find_llama_server() == on_path
    default = fake_binary(tmp_path / "shared")
    monkeypatch.setattr(peers, "DEFAULT_LLAMA_SERVER", default)
    assert peers.find_llama_server() == default
    from_env = fake_binary(tmp_path / "env")
    monkeypatch.setenv(peers.LLAMA_SERVER_ENV, str(from_env))
    assert peers.find_llama_server() == from_env
    explicit = fake_binary(tmp_path / "arg")
    assert peers.find_llama_server(explicit) == explicit
    assert peers.find_llama_server(explicit.parent) == explicit  # a folder holding llama-server


def test_explicit_choice_that_does_not_exist_is_not_replaced(no_server, monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "DEFAULT_LLAMA_SERVER", fake_binary(tmp_path / "shared"))
    assert peers.find_llama_server(tmp_path / "nope" / "llama-server") is None
    monkeypatch.setenv(peers.LLAMA_SERVER_ENV, str(tmp_path / "nope2"))
    assert peers.find_llama_server() is None
    assert "nope2" in peers.llamaserver_available("smollm2-135m")


def test_absent_reasons(no_server, monkeypatch, tmp_path):
    assert "llama-server not found" in peers.llamaserver_available("smollm2-135m")
    binary = fake_binary(tmp_path / "bin")
    assert "GGUF files only" in peers.llamaserver_available(str(tmp_path), binary)  # a directory, not a GGUF
    assert "no such file" in peers.llamaserver_available(str(tmp_path / "x.gguf"), binary)


def test_command_gives_every_slot_2048_tokens():
    cmd = peers.llama_server_command(Path("llama-server"), Path("m.gguf"), 8080, num_threads=3, slots=16)
    arg = lambda flag: cmd[cmd.index(flag) + 1]  # noqa: E731
    assert arg("--parallel") == "16" and arg("-c") == str(16 * 2048) and "--no-kv-unified" in cmd
    assert arg("-t") == arg("-tb") == "3" and arg("--host") == "127.0.0.1" and arg("--port") == "8080"


def test_throughput_cli_reports_absent_server(tiny_llama, tmp_path):
    from tokenmill.entrypoints.cli import main

    out = tmp_path / "r.json"
    assert (
        main(
            [
                "bench",
                "throughput",
                "--model",
                str(tiny_llama),
                "--max-model-len",
                "256",
                "--num-gpu-blocks-override",
                "128",
                "--dataset-name",
                "random",
                "--num-prompts",
                "2",
                "--input-len",
                "8",
                "--output-len",
                "4",
                "--peers",
                "llamaserver",
                "--llama-server",
                str(tmp_path / "missing"),
                "--output-json",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["llamaserver"]["available"] is False and "not found" in r["llamaserver"]["reason"]
    assert "ratio_vs_llamaserver" not in r


@pytest.mark.skipif(
    peers.llamaserver_available() is not None, reason=f"no llama-server to run: {peers.llamaserver_available()}"
)
def test_real_server_two_slots(gguf_tokenizer):
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    requests = [SampleRequest(p, gguf_tokenizer.encode(p), 8) for p in prompts]
    with peers.LlamaServerPeer("smollm2-135m", num_threads=1, slots=2, startup_timeout=60) as server:
        r = server.throughput(requests)
        proc = server.proc
    assert proc.poll() is not None  # stopped on exit
    assert r["errors"] == [] and r["num_mismatched_outputs"] == 0
    assert r["generated_tokens"] == r["output_tokens"] == 24 and r["slots"] == 2
    assert r["output_tok_s"] > 0


def test_server_that_dies_at_startup_is_an_error_with_its_log(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'cannot load model' >&2\nexit 3\n")
    binary.chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    with pytest.raises(RuntimeError, match="exited with code 3(.|\n)*cannot load model"):
        peers.LlamaServerPeer(str(model), num_threads=1, slots=2, binary=binary, startup_timeout=10)
