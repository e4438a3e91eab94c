"""The server probe's findings (issue 16): any string anywhere is a 4xx or a 200, never a 5xx;
cache_salt isolates prefix-cache blocks; stalled clients are disconnected; an over-long prompt is
refused without tokenizing it."""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
import uuid

import httpx
import openai
import pytest

from tests.server.conftest import DEFAULT_ARGS, MODEL, metric_values, start_server

pytestmark = pytest.mark.slow

READ_TIMEOUT_S = 2.0
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("probe"),
        *DEFAULT_ARGS,
        "--header-timeout",
        str(READ_TIMEOUT_S),
        "--body-timeout",
        str(READ_TIMEOUT_S),
    )
    yield server
    server.stop()


def _post_raw(conn: http.client.HTTPConnection, server, path: str, body: dict) -> tuple[int, dict]:
    # NOTE: json.dumps escapes a lone surrogate as \ud800, which is what a client on the wire sends
    conn.request("POST", path, body=json.dumps(body), headers={**server.headers, "Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


# --- 1. any string in any field: a 4xx in OpenAI's format or a 200, and the connection stays open ---


def _cmpl(**kw):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 1, **kw}


def _chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **kw}


def _string_cases(s: str) -> list[tuple[str, str, dict]]:
    return [
        ("cmpl-model", CMPL, _cmpl(model=s)),
        ("cmpl-prompt", CMPL, _cmpl(prompt=s)),
        ("cmpl-prompt-list", CMPL, _cmpl(prompt=["ok", s])),
        ("cmpl-stop", CMPL, _cmpl(stop=s)),
        ("cmpl-stop-list", CMPL, _cmpl(stop=[s])),
        ("cmpl-user", CMPL, _cmpl(user=s)),
        ("cmpl-cache-salt", CMPL, _cmpl(cache_salt=s)),
        ("cmpl-max-tokens", CMPL, _cmpl(max_tokens=s)),
        ("cmpl-unknown-key", CMPL, {**_cmpl(), s: 1}),
        ("chat-model", CHAT, _chat(model=s)),
        ("chat-content", CHAT, _chat(messages=[{"role": "user", "content": s}])),
        ("chat-content-part", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "text", "text": s}]}])),
        ("chat-part-type", CHAT, _chat(messages=[{"role": "user", "content": [{"type": s, "text": "x"}]}])),
        ("chat-role", CHAT, _chat(messages=[{"role": s, "content": "hi"}])),
        ("chat-name", CHAT, _chat(messages=[{"role": "user", "content": "hi", "name": s}])),
        ("chat-message-extra", CHAT, _chat(messages=[{"role": "user", "content": "hi", s: s}])),
        ("chat-stop", CHAT, _chat(stop=[s])),
        ("chat-user", CHAT, _chat(user=s)),
        ("chat-cache-salt", CHAT, _chat(cache_salt=s)),
        ("chat-unknown-key", CHAT, {**_chat(), s: 1}),
        ("tokenize-model", "/tokenize", {"model": s, "prompt": "hi"}),
        ("tokenize-prompt", "/tokenize", {"prompt": s}),
        ("tokenize-messages", "/tokenize", {"messages": [{"role": "user", "content": s}]}),
        ("detokenize-model", "/detokenize", {"model": s, "tokens": [1]}),
        ("detokenize-tokens", "/detokenize", {"tokens": [s]}),
    ]


NASTY = {
    "lone-high-surrogate": "\ud800",
    "lone-low-surrogate": "x\udfff",
    "reversed-pair": "\udc00\ud800",
    "nul-and-controls": "a\x00\x1b[2J\u202e",
    "astral": "\U0001f600",
}
CASES = [(f"{sname}/{cname}", path, body) for sname, s in NASTY.items() for cname, path, body in _string_cases(s)]


@pytest.mark.parametrize("name,path,body", CASES, ids=[c[0] for c in CASES])
def test_any_string_in_any_field_is_a_4xx_or_200_and_keeps_the_connection(srv, name, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        status, reply = _post_raw(conn, srv, path, body)
        assert status == 200 or 400 <= status < 500, (status, reply)
        if status != 200:
            assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}, reply
            reply["error"]["message"].encode("utf-8")  # strict: nothing unencodable is echoed
        sock = conn.sock
        assert sock is not None  # the server did not ask to close it
        conn.request("GET", "/v1/models", headers=srv.headers)
        r = conn.getresponse()
        assert r.status == 200 and r.read()
        assert conn.sock is sock  # answered on the same keep-alive connection
    finally:
        conn.close()


@pytest.mark.parametrize("path", [CMPL, CHAT, "/tokenize", "/detokenize"])
def test_lone_surrogate_model_is_a_404_that_escapes_the_name(srv, path):
    body = {"model": "gpt\ud800x", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "tokens": [1]}
    keep = {CMPL: ("prompt",), CHAT: ("messages",), "/tokenize": ("prompt",), "/detokenize": ("tokens",)}[path]
    body = {k: v for k, v in body.items() if k == "model" or k in keep}
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        status, reply = _post_raw(conn, srv, path, body)
    finally:
        conn.close()
    assert status == 404, reply
    assert reply["error"]["code"] == "model_not_found" and reply["error"]["param"] == "model"
    assert "gpt\\ud800x" in reply["error"]["message"]


# --- 2. cache_salt ---


def _cached_tokens(reply) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


def _prefix_hits(server) -> float:
    return metric_values(httpx.get(f"{server.url}/metrics").text)["tokenmill:prefix_cache_hits_total"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_cache_salt_isolates_prefix_cache_blocks(srv, endpoint):
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=120)
    # NOTE: a fresh nonce first so no earlier request shares even the first block; ~100 tokens = 6 blocks
    nonce = uuid.uuid4().hex
    text = f"{nonce} " + "The quick brown fox jumps over the lazy dog near the river bank. " * 8

    def send(salt: str | None):
        extra = {} if salt is None else {"cache_salt": salt}
        hits = _prefix_hits(srv)
        if endpoint == "completions":
            reply = client.completions.create(model=MODEL, prompt=text, max_tokens=1, extra_body=extra)
        else:
            reply = client.chat.completions.create(
                model=MODEL,
                max_tokens=1,
                extra_body=extra,
                messages=[{"role": "system", "content": nonce}, {"role": "user", "content": text}],
            )
        return _cached_tokens(reply), _prefix_hits(srv) - hits

    assert send("tenant-a") == (0, 0)
    cached, hits = send("tenant-a")  # same salt: the prompt's full blocks come from the cache
    assert cached >= 5 * 16 and hits == cached
    assert send("tenant-b") == (0, 0)  # another tenant's salt shares nothing
    assert send(None) == (0, 0)  # nor does an unsalted request
    cached, hits = send("tenant-b")
    assert cached >= 5 * 16 and hits == cached


@pytest.mark.parametrize(
    "path,body",
    [
        (CMPL, _cmpl(cache_salt="")),
        (CHAT, _chat(cache_salt="")),
        (CMPL, _cmpl(cache_salt=123)),
        (CHAT, _chat(cache_salt=["a"])),
    ],
)
def test_cache_salt_must_be_a_non_empty_string(srv, path, body):
    r = httpx.post(f"{srv.url}{path}", json=body, headers=srv.headers, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"


def test_lone_surrogate_cache_salt_is_a_400_and_the_engine_lives_on(srv):
    # NOTE: the chat template makes the prompt longer than one block, so the salt would be hashed
    for path, body in ((CMPL, _cmpl(prompt="hello " * 40)), (CHAT, _chat())):
        r = httpx.post(
            f"{srv.url}{path}",
            content=json.dumps({**body, "cache_salt": "a\ud800"}),
            headers={**srv.headers, "Content-Type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    r = httpx.post(f"{srv.url}{CHAT}", json=_chat(cache_salt="ok"), headers=srv.headers, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


# --- 3. read timeouts ---


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True when the server closes the connection (recv returns b'') before within_s."""
    sock.settimeout(within_s)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_partial_headers_are_cut_off(srv):
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert _closed_by_server(s, READ_TIMEOUT_S + 10)


def test_trickled_headers_do_not_extend_the_deadline(srv):
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nX-Slow: ")
        closed, deadline = False, time.monotonic() + READ_TIMEOUT_S + 10
        while not closed and time.monotonic() < deadline:
            readable, _, _ = select.select([s], [], [], 0.25)
            try:
                if readable:
                    closed = s.recv(1) == b""
                else:
                    s.sendall(b"x")  # one more byte of the header every 0.25 s
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed


def test_a_connection_that_never_sends_anything_is_cut_off(srv):
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        assert _closed_by_server(s, READ_TIMEOUT_S + 10)


def test_unfinished_body_is_cut_off(srv):
    body = json.dumps(_cmpl()).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {srv.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(head + body[:-5])
        assert _closed_by_server(s, READ_TIMEOUT_S + 10)


def test_partial_second_request_on_a_keep_alive_connection_is_cut_off(srv):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("GET", "/health")
    assert conn.getresponse().read() == b'{"status":"ok"}'
    conn.sock.sendall(b"GET /health HTTP/1.1\r\n")
    assert _closed_by_server(conn.sock, READ_TIMEOUT_S + 10)
    conn.close()


def test_no_deadline_while_the_response_is_computed_and_streamed(srv):
    # ~100 tokens take several seconds on a CPU, longer than both read timeouts
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=120)
    reply = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=100, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 100
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=100,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 100
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text


def test_timeout_flags_are_validated(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--header-timeout", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--header-timeout must be a positive number" in out.stderr


# --- 4. an over-long prompt is refused before it is tokenized ---


@pytest.mark.parametrize(
    "path,body,param",
    [
        (CMPL, {"prompt": "x" * 5_000_000, "max_tokens": 2}, "prompt"),
        (CMPL, {"prompt": ["short", "hello world " * 450_000], "max_tokens": 2}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": "y" * 5_000_000}]}, "messages"),
        ("/tokenize", {"prompt": "z" * 5_000_000}, "prompt"),
    ],
)
def test_five_megabyte_prompt_is_a_quick_400_naming_the_context_length(srv, path, body, param):
    r = httpx.post(f"{srv.url}{path}", json=body, headers=srv.headers, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param
    # "at least N tokens": the bound from the text's length answered, so the prompt was never tokenized
    # (an exact count, as in the test below, means it was)
    assert "maximum context length is 512 tokens" in err["message"] and "at least" in err["message"]


def test_prompt_near_the_limit_is_still_counted_exactly(srv):
    # 4000 chars of "hello " may or may not fit by length alone; the exact count decides
    r = httpx.post(
        f"{srv.url}{CMPL}", json={"prompt": "hello " * 700, "max_tokens": 2}, headers=srv.headers, timeout=60
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "at least" not in err["message"], err
    n = httpx.post(f"{srv.url}/tokenize", json={"prompt": "hello " * 700}, headers=srv.headers).json()["count"]
    assert f"({n} in the prompt" in err["message"]
