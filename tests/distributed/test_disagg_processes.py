"""Disaggregated serving across real processes on 127.0.0.1: a prefill worker, a decode worker (`tokenmill serve
--kv-role ...`, the K/V moving over torch.distributed gloo) and `tokenmill router`, driven by the `openai`
client. Greedy float32 output equals the colocated engine's; the faults of a prefill worker that dies, a
transfer that times out and a decode worker that restarts end in a recompute or a clear 503, with every KV
block back in both pools."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import REPO, free_port, metric_values, start_server

pytestmark = pytest.mark.slow

ARGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "256",
    "--kv-cache-memory-bytes",
    str(64 << 20),
)
HOLD_S = 4.0
LONG = (
    "Explain, in a few careful sentences, why the sky looks blue during the day and red at sunset, "
    "and what that has to do with the wavelength of light and the thickness of the atmosphere."
)


TOPICS = ["tides", "volcanoes", "bread yeast", "glaciers", "compilers", "bird migration", "batteries", "coral reefs"]


def fresh(i: int) -> str:
    """A long prompt whose first tokens no earlier prompt shares (the decode worker has none of it cached)."""
    return f"{TOPICS[i]}: " + LONG.replace("the sky looks blue", f"{TOPICS[i]} behave as they do")


def start_router(tmp_path, prefill: list[str], decode: list[str], min_prefill_tokens: int = 32):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.entrypoints.cli",
        "router",
        "--port",
        str(port),
        "--cooldown",
        "1",
        "--min-prefill-tokens",
        str(min_prefill_tokens),
        "--prefill",
        *prefill,
        "--decode",
        *decode,
    ]
    log = open(tmp_path / f"router-{port}.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code in (200, 503):
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError((tmp_path / f"router-{port}.log").read_text())


class Cluster:
    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.kv_port = free_port()
        self.prefill = self.start_prefill()
        self.decode = start_server(
            tmp_path,
            *ARGS,
            "--kv-role",
            "decode",
            "--kv-transfer-config",
            json.dumps({"transfer_timeout_s": 3.0}),
            api_key=None,
        )
        self.router, self.url = start_router(tmp_path, [self.prefill.url], [self.decode.url])

    def start_prefill(self, port: int | None = None):
        args = [
            *ARGS,
            "--kv-role",
            "prefill",
            "--kv-transfer-config",
            json.dumps({"kv_port": self.kv_port, "hold_timeout_s": HOLD_S}),
        ]
        return start_server(self.tmp, *args, api_key=None, **({"port": port} if port else {}))

    def stop(self):
        self.router.kill()
        self.router.wait()
        for s in (self.prefill, self.decode):
            s.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("disagg"))
    yield c
    c.stop()


def chat(url: str, content: str, **kw) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=24, **kw
    )
    return r.choices[0].message.content


def chat_stream(url: str, content: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    s = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=24, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in s if c.choices)


def metrics(url: str) -> dict[str, float]:
    return metric_values(httpx.get(f"{url}/metrics", timeout=10).text)


def pool_whole(url: str, timeout: float = 30.0) -> dict:
    """Wait until the worker is idle with every block free and its integrity check passing."""
    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(f"{url}/debug/kv_cache", timeout=10).json()
        if kv["is_idle"] and kv["integrity"] == "ok" and kv["num_blocks_free"] == kv["num_blocks_total"]:
            return kv
        if time.monotonic() > deadline:
            raise AssertionError(f"KV pool not whole: {kv}")
        time.sleep(0.2)


def test_router_disaggregated_equals_colocated(cluster):
    prompts = [
        LONG,
        LONG.replace("sky", "sea"),
        "Write a short poem about paged memory and the blocks it holds, "
        "in the voice of a tired operating system that has seen too many page faults.",
    ]
    colocated = [chat(cluster.prefill.url, p) for p in prompts]  # a plain request: served where it arrives
    before = metrics(cluster.decode.url)
    got = [chat(cluster.url, p) for p in prompts]
    assert got == colocated
    after = metrics(cluster.decode.url)
    assert after["tokenmill:kv_transfer_loads_total"] - before.get("tokenmill:kv_transfer_loads_total", 0) == 3
    assert after["tokenmill:kv_transfer_bytes_loaded_total"] > before.get("tokenmill:kv_transfer_bytes_loaded_total", 0)
    assert after.get("tokenmill:kv_transfer_loads_failed_total", 0) == before.get(
        "tokenmill:kv_transfer_loads_failed_total", 0
    )
    fresh = "Describe how a librarian would organise ten thousand books that arrive in one afternoon, step by step."
    assert chat_stream(cluster.url, fresh) == chat(cluster.prefill.url, fresh)
    r = metrics(cluster.url)
    assert r["tokenmill:router_num_disaggregated_total"] >= 4
    p = metrics(cluster.prefill.url)
    assert p["tokenmill:kv_transfer_sends_total"] >= 4 and p["tokenmill:kv_transfer_bytes_sent_total"] > 0
    pool_whole(cluster.prefill.url)
    pool_whole(cluster.decode.url)


def test_short_or_cached_prompts_stay_on_the_decode_worker(cluster):
    before = metrics(cluster.url)
    assert chat(cluster.url, "Hi!") == chat(cluster.prefill.url, "Hi!")  # a few tokens: not worth a transfer
    assert chat(cluster.url, LONG) == chat(cluster.prefill.url, LONG)  # cached on the decode worker already
    after = metrics(cluster.url)
    assert after["tokenmill:router_num_colocated_total"] - before["tokenmill:router_num_colocated_total"] == 2
    assert after["tokenmill:router_num_disaggregated_total"] == before["tokenmill:router_num_disaggregated_total"]


def _hold(cluster, content: str) -> dict:
    """The router's first hop by hand: the prefill worker computes the prompt and holds its K/V."""
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    r = httpx.post(f"{cluster.prefill.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _decode_with(cluster, content: str, params: dict) -> str:
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 24,
        "kv_transfer_params": {"do_remote_prefill": True, **params},
    }
    r = httpx.post(f"{cluster.decode.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_bad_kv_transfer_params_are_a_400(cluster):
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1"},
    }
    r = httpx.post(f"{cluster.decode.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "kv_transfer_params" in r.json()["error"]["message"]
    body["kv_transfer_params"] = {"do_remote_decode": True}
    r = httpx.post(f"{cluster.decode.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "does not hold" in r.json()["error"]["message"]


def test_transfer_timeout_recomputes_and_leaks_nothing(cluster):
    content = fresh(3)
    want = chat(cluster.prefill.url, content)
    params = _hold(cluster, content)
    held_at = time.monotonic()
    cluster.prefill.proc.send_signal(signal.SIGSTOP)  # frozen: the pull can only time out
    try:
        before = metrics(cluster.decode.url)
        assert _decode_with(cluster, content, params) == want
        after = metrics(cluster.decode.url)
        assert (
            after["tokenmill:kv_transfer_loads_failed_total"]
            - before.get("tokenmill:kv_transfer_loads_failed_total", 0)
            == 1
        )
        # Thawed before its deadline, the worker would rightly serve the late pull (no expiry to count): stay
        # frozen past it. Thawed after, the late pull is refused and the hold expires.
        time.sleep(max(0.0, held_at + HOLD_S + 0.5 - time.monotonic()))
    finally:
        cluster.prefill.proc.send_signal(signal.SIGCONT)
    pool_whole(cluster.decode.url)
    pool_whole(cluster.prefill.url, timeout=HOLD_S + 20)  # the hold expires; its blocks come back
    assert metrics(cluster.prefill.url)["tokenmill:kv_transfer_holds_expired_total"] >= 1


def test_prefill_worker_death_recomputes_and_router_keeps_serving(cluster):
    content = fresh(4)
    want = chat(cluster.prefill.url, content)
    params = _hold(cluster, content)
    port = cluster.prefill.port
    cluster.prefill.stop(signal.SIGKILL)
    assert _decode_with(cluster, content, params) == want  # the pull fails; the decode worker recomputes
    before = metrics(cluster.url)
    assert chat(cluster.url, fresh(0)) == chat(cluster.decode.url, fresh(0))
    assert metrics(cluster.url)["tokenmill:router_num_prefill_failures_total"] > before.get(
        "tokenmill:router_num_prefill_failures_total", 0
    )
    pool_whole(cluster.decode.url)
    cluster.prefill = cluster.start_prefill(port)  # back on the same ports: disaggregation resumes
    time.sleep(1.5)  # the router's cooldown
    before = metrics(cluster.decode.url)
    got = chat(cluster.url, fresh(1))
    assert got == chat(cluster.prefill.url, fresh(1))
    assert (
        metrics(cluster.decode.url)["tokenmill:kv_transfer_loads_total"] > before["tokenmill:kv_transfer_loads_total"]
    )


def test_decode_worker_restart(cluster):
    content = fresh(2)
    want = chat(cluster.prefill.url, content)
    port = cluster.decode.port
    cluster.decode.stop(signal.SIGKILL)
    r = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        timeout=60,
        json={"model": "smollm2-135m", "messages": [{"role": "user", "content": content}], "max_tokens": 4},
    )
    assert r.status_code == 503 and "no decode worker" in r.json()["error"]["message"]
    pool_whole(cluster.prefill.url, timeout=HOLD_S + 20)  # nothing held for the dead worker stays held
    cluster.decode = start_server(
        cluster.tmp,
        *ARGS,
        "--kv-role",
        "decode",
        "--kv-transfer-config",
        json.dumps({"transfer_timeout_s": 3.0}),
        api_key=None,
        port=port,
    )
    assert chat(cluster.url, content) == want  # a new session to the same prefill worker
    assert metrics(cluster.decode.url)["tokenmill:kv_transfer_loads_total"] == 1
    pool_whole(cluster.prefill.url)
    pool_whole(cluster.decode.url)
