"""Malformed requests: each gets the right 4xx with OpenAI's error object, never a 5xx."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL

pytestmark = pytest.mark.slow

CMPL, CHAT, EMBD = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
MSGS = [{"role": "user", "content": "hi"}]


def cmpl(**kw):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": MSGS, "max_tokens": 2, **kw}


# (id, method, path, body (dict/list/str, or bytes sent raw), expected status, expected param or None)
CASES = [
    ("broken-json", "POST", CMPL, b'{"model": "smollm2-135m", "prompt": "hi",', 400, None),
    ("not-json-at-all", "POST", CHAT, b"hello there", 400, None),
    ("body-is-array", "POST", CMPL, [1, 2, 3], 400, None),
    ("body-is-string", "POST", CHAT, "just a string", 400, None),
    ("prompt-wrong-type", "POST", CMPL, cmpl(prompt=123), 400, "prompt"),
    ("n-over-max-num-seqs", "POST", CMPL, cmpl(n=100), 400, "n"),
    ("prompt-mixed-list", "POST", CMPL, cmpl(prompt=["a", 1]), 400, "prompt"),
    ("max-tokens-string", "POST", CMPL, cmpl(max_tokens="lots"), 400, "max_tokens"),
    ("messages-string", "POST", CHAT, chat(messages="hi"), 400, "messages"),
    ("temperature-list", "POST", CHAT, chat(temperature=[1]), 400, "temperature"),
    ("stream-object", "POST", CMPL, cmpl(stream={"a": 1}), 400, "stream"),
    ("negative-max-tokens", "POST", CMPL, cmpl(max_tokens=-1), 400, "max_tokens"),
    ("zero-n", "POST", CHAT, chat(n=0), 400, "n"),
    ("negative-temperature", "POST", CHAT, chat(temperature=-0.5), 400, "temperature"),
    ("top-p-zero", "POST", CMPL, cmpl(top_p=0), 400, "top_p"),
    ("negative-logprobs", "POST", CMPL, cmpl(logprobs=-1), 400, "logprobs"),
    ("presence-penalty-huge", "POST", CHAT, chat(presence_penalty=5), 400, "presence_penalty"),
    ("huge-max-tokens", "POST", CMPL, cmpl(max_tokens=10**12), 400, "max_tokens"),
    ("max-tokens-over-context", "POST", CMPL, cmpl(max_tokens=100000), 400, "max_tokens"),
    ("huge-n", "POST", CHAT, chat(n=10**6), 400, "n"),
    ("huge-logprobs", "POST", CMPL, cmpl(logprobs=100), 400, "logprobs"),
    ("huge-top-logprobs", "POST", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("huge-seed", "POST", CMPL, cmpl(seed=2**80), 400, "seed"),
    ("infinite-temperature", "POST", CMPL, b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature"),
    ("nan-top-p", "POST", CMPL, b'{"prompt": "hi", "top_p": NaN}', 400, "top_p"),
    ("min-tokens-over-max", "POST", CMPL, cmpl(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    ("unknown-field", "POST", CMPL, cmpl(foo=1), 400, "foo"),
    ("unknown-field-chat", "POST", CHAT, chat(frobnicate=True), 400, "frobnicate"),
    ("unsupported-logit-bias", "POST", CMPL, cmpl(logit_bias={"50256": -100}), 400, "logit_bias"),
    ("unsupported-suffix", "POST", CMPL, cmpl(suffix="end"), 400, "suffix"),
    ("unsupported-best-of", "POST", CMPL, cmpl(best_of=3), 400, "best_of"),
    ("huge-prompt-logprobs", "POST", CMPL, cmpl(prompt_logprobs=21), 400, "prompt_logprobs"),
    ("chat-stream-prompt-logprobs", "POST", CHAT, chat(stream=True, prompt_logprobs=1), 400, "prompt_logprobs"),
    ("negative-max-tokens-echo", "POST", CMPL, cmpl(max_tokens=-1, echo=True, logprobs=1), 400, "max_tokens"),
    ("embeddings-missing-input", "POST", EMBD, {"model": MODEL}, 400, "input"),
    ("embeddings-input-wrong-type", "POST", EMBD, {"input": 12}, 400, "input"),
    ("embeddings-empty-string", "POST", EMBD, {"input": ""}, 400, "input"),
    ("embeddings-empty-list", "POST", EMBD, {"input": []}, 400, "input"),
    ("embeddings-empty-token-list", "POST", EMBD, {"input": [[1, 2], []]}, 400, "input"),
    ("embeddings-token-out-of-range", "POST", EMBD, {"input": [1, 10**9]}, 400, "input"),
    ("embeddings-over-long", "POST", EMBD, {"input": "hello " * 2000}, 400, "input"),
    ("embeddings-bad-encoding", "POST", EMBD, {"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ("embeddings-dimensions-over-hidden", "POST", EMBD, {"input": "hi", "dimensions": 100000}, 400, "dimensions"),
    ("embeddings-zero-dimensions", "POST", EMBD, {"input": "hi", "dimensions": 0}, 400, "dimensions"),
    ("embeddings-unknown-field", "POST", EMBD, {"input": "hi", "pooling": "cls"}, 400, "pooling"),
    ("embeddings-unknown-model", "POST", EMBD, {"input": "hi", "model": "gpt-9"}, 404, "model"),
    (
        "tool-of-unknown-type",
        "POST",
        CHAT,
        chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]),
        400,
        "tools.0.type",
    ),
    ("tool-choice-without-tools", "POST", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("unknown-response-format", "POST", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type"),
    (
        "json-schema-not-json",
        "POST",
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
            }
        ),
        400,
        "structured_outputs.json",
    ),
    (
        "unsupported-image",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "messages.content",
    ),
    ("top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    (
        "stream-options-without-stream",
        "POST",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    ("empty-messages", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("message-without-role", "POST", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages.0.role"),
    ("message-bad-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role"),
    (
        "user-message-null-content",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": None}]),
        400,
        "messages.content",
    ),
    ("missing-prompt", "POST", CMPL, {"model": MODEL}, 400, "prompt"),
    ("missing-messages", "POST", CHAT, {"model": MODEL}, 400, "messages"),
    ("empty-prompt", "POST", CMPL, cmpl(prompt=""), 400, "prompt"),
    ("empty-prompt-list", "POST", CMPL, cmpl(prompt=[]), 400, "prompt"),
    ("empty-stop-string", "POST", CMPL, cmpl(stop=[""]), 400, "stop"),
    ("over-long-prompt", "POST", CMPL, cmpl(prompt="hello " * 2000), 400, "prompt"),
    ("over-long-chat", "POST", CHAT, chat(messages=[{"role": "user", "content": "hello " * 2000}]), 400, "messages"),
    ("token-id-out-of-range", "POST", CMPL, cmpl(prompt=[1, 2, 10**9]), 400, "prompt"),
    ("lone-surrogate", "POST", CMPL, b'{"prompt": "bad \\ud800 text", "max_tokens": 2}', 400, "prompt"),
    ("unknown-model", "POST", CMPL, cmpl(model="gpt-9"), 404, "model"),
    ("unknown-model-chat", "POST", CHAT, chat(model="gpt-9"), 404, "model"),
    ("unknown-model-get", "GET", "/v1/models/gpt-9", None, 404, "model"),
    ("detokenize-out-of-range", "POST", "/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("tokenize-neither", "POST", "/tokenize", {}, 400, "prompt"),
    ("wrong-method", "GET", CMPL, None, 405, None),
    ("unknown-path", "POST", "/v1/nothing-here", {}, 404, None),
]


def _send(server, method, path, body, headers):
    kw = {}
    if isinstance(body, bytes):
        kw["content"] = body
        headers = {**headers, "Content-Type": "application/json"}
    elif body is not None:
        kw["json"] = body
    return httpx.request(method, f"{server.url}{path}", headers=headers, timeout=60, **kw)


def _assert_error_object(r):
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


@pytest.mark.parametrize("name,method,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, name, method, path, body, status, param):
    r = _send(server, method, path, body, server.headers)
    assert r.status_code == status, (r.status_code, r.text)
    err = _assert_error_object(r)
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer"}],
    ids=["missing", "wrong", "basic", "empty"],
)
@pytest.mark.parametrize("path", [CMPL, CHAT, "/v1/models", "/tokenize"])
def test_api_key_required(server, headers, path):
    method = "GET" if path == "/v1/models" else "POST"
    r = _send(server, method, path, None if method == "GET" else cmpl(), headers)
    assert r.status_code == 401
    err = _assert_error_object(r)
    assert err["code"] == "invalid_api_key"


def test_open_endpoints_need_no_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_server_still_healthy_after_bad_input(server):
    r = httpx.post(f"{server.url}{CMPL}", json=cmpl(max_tokens=3, temperature=0), headers=server.headers, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
