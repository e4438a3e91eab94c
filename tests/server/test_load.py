"""Bounded load on loopback: 128 concurrent streaming clients with ShareGPT prompts; a third of them
disconnect mid-stream. Every finished request has the right token count, /metrics agrees, and all
KV blocks are free afterwards."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, load_sharegpt_prompts, metric_values

pytestmark = pytest.mark.slow

NUM_CLIENTS = 128
MAX_TOKENS = 6
PROMPT_CHARS = 100  # ~25 tokens: the test measures correctness under concurrency, not throughput


async def _one_client(client: openai.AsyncOpenAI, i: int, prompt: str, disconnect: bool) -> dict:
    """Stream one request; return what the client saw."""
    kw = dict(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=i,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    if i % 2:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    else:
        stream = await client.completions.create(prompt=prompt, **kw)
    seen = {"i": i, "disconnected": False, "finish_reason": None, "usage": None, "num_chunks": 0}
    try:
        async for chunk in stream:
            if chunk.usage is not None:
                seen["usage"] = chunk.usage
            for c in chunk.choices:
                seen["num_chunks"] += 1
                if c.finish_reason is not None:
                    seen["finish_reason"] = c.finish_reason
            if disconnect and seen["num_chunks"] >= 2:
                seen["disconnected"] = True
                break
    finally:
        await stream.close()
    return seen


async def _run_load(url: str, api_key: str, prompts: list[str]) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=NUM_CLIENTS + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as http:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, http_client=http, max_retries=0)
        return await asyncio.gather(
            *[_one_client(client, i, p, disconnect=(i % 3 == 2)) for i, p in enumerate(prompts)]
        )


def _prompt_tokens(server, i: int, prompt: str) -> int:
    body = {"messages": [{"role": "user", "content": prompt}]} if i % 2 else {"prompt": prompt}
    return httpx.post(f"{server.url}/tokenize", json=body, headers=server.headers).json()["count"]


def _wait_idle(server, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(f"{server.url}/debug/kv_cache", headers=server.headers).json()
        if kv["is_idle"] and kv["num_open_streams"] == 0:
            return kv
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout} s: {kv}")
        time.sleep(0.2)


def test_load_128_streaming_clients_with_disconnects(server):
    prompts = load_sharegpt_prompts(NUM_CLIENTS, max_chars=PROMPT_CHARS)
    expected_prompt_tokens = sum(_prompt_tokens(server, i, p) for i, p in enumerate(prompts))
    _wait_idle(server)
    before = metric_values(httpx.get(f"{server.url}/metrics").text)

    t0 = time.monotonic()
    results = asyncio.run(_run_load(server.url, server.api_key, prompts))
    elapsed = time.monotonic() - t0

    kv = _wait_idle(server)
    after = metric_values(httpx.get(f"{server.url}/metrics").text)

    completed = [r for r in results if not r["disconnected"]]
    disconnected = [r for r in results if r["disconnected"]]
    # NOTE: under load the server may coalesce tokens into fewer chunks, so a would-be leaver can finish first.
    assert 0 < len(disconnected) <= sum(1 for i in range(NUM_CLIENTS) if i % 3 == 2)
    for r in completed:
        assert r["finish_reason"] == "length", r
        assert r["usage"] is not None and r["usage"].completion_tokens == MAX_TOKENS, r

    # Nothing left behind: every block free, the allocator's own integrity check passes.
    assert kv["num_blocks_free"] == kv["num_blocks_total"], kv
    assert kv["integrity"] == "ok", kv
    assert kv["num_running"] == kv["num_waiting"] == 0

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    label = f'{{model_name="{MODEL}"}}'
    assert after[f"tokenmill:num_requests_running{label}"] == 0
    assert after[f"tokenmill:num_requests_waiting{label}"] == 0
    assert after[f"tokenmill:kv_cache_usage_perc{label}"] == 0
    assert delta("tokenmill:prompt_tokens_total") == expected_prompt_tokens
    gen = delta("tokenmill:generation_tokens_total")
    assert len(completed) * MAX_TOKENS <= gen <= NUM_CLIENTS * MAX_TOKENS
    reasons = {
        r: delta(f'tokenmill:request_success_total{{finished_reason="{r}",model_name="{MODEL}"}}')
        for r in ("stop", "length", "abort")
    }
    # A client that disconnects after the engine finished its request counts as finished, not aborted.
    assert reasons["stop"] == 0
    assert reasons["length"] + reasons["abort"] == NUM_CLIENTS
    assert len(completed) <= reasons["length"] <= NUM_CLIENTS
    assert delta("tokenmill:e2e_request_latency_seconds_count") == reasons["length"]
    assert delta("tokenmill:time_to_first_token_seconds_count") >= len(completed)
    assert delta("tokenmill:request_generation_tokens_sum") == reasons["length"] * MAX_TOKENS
    print(
        f"\n{NUM_CLIENTS} clients ({len(disconnected)} disconnected) in {elapsed:.1f} s; "
        f"{int(gen)} tokens generated; finish reasons {reasons}"
    )


def test_non_streaming_client_disconnect_aborts(server):
    """A plain (non-SSE) request whose client goes away is aborted too, not run to the end."""
    _wait_idle(server)
    before = metric_values(httpx.get(f"{server.url}/metrics").text)
    body = {
        "model": MODEL,
        "prompt": "Write a long essay about rivers.",
        "max_tokens": 450,
        "temperature": 0,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=2.0)
    kv = _wait_idle(server, timeout=120)
    after = metric_values(httpx.get(f"{server.url}/metrics").text)
    assert kv["num_blocks_free"] == kv["num_blocks_total"] and kv["integrity"] == "ok", kv
    # Proven by the counters, not by how soon the engine went idle: one abort, and fewer tokens than asked.
    abort = f'tokenmill:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}'
    length = f'tokenmill:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'
    assert after.get(abort, 0) - before.get(abort, 0) == 1
    assert after.get(length, 0) - before.get(length, 0) == 0
    gen = after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"]
    assert gen < 450
