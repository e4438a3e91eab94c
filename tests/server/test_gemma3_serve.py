"""`tokenmill serve --model gemma3-270m` (the alias of the offline Gemma 3 GGUF) answers the `openai` client:
greedy completions, streamed and not, equal to the offline engine's tokens; a prompt longer than the
512-token window; the base model's missing chat template is a 400, not a crash."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import metric_values, start_server

pytestmark = pytest.mark.slow
ALIAS = "gemma3-270m"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(
        tmp_path_factory.mktemp("gemma_server"), "--model", ALIAS, "--dtype", "float32", load_timeout=400.0, threads=2
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=300)


def long_prompt() -> str:
    from tests.models.test_gemma3 import DATA

    text = ""
    for line in (DATA / "wikitext2_raw_test.jsonl").open():
        text += json.loads(line)["text"]
        if len(text) > 3200:  # ~700 tokens
            return text
    raise AssertionError


def test_gemma3_alias_serves_the_openai_client(server, client):
    from tokenmill import LLM, SamplingParams

    assert [m.id for m in client.models.list().data] == [ALIAS]
    prompts = PROMPTS + [long_prompt()]
    got = []
    for i, p in enumerate(prompts):
        if i % 2:  # streamed
            chunks = client.completions.create(
                model=ALIAS, prompt=p, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True}
            )
            got.append("".join(c.choices[0].text for c in chunks if c.choices))
        else:
            r = client.completions.create(
                model=ALIAS, prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
            )
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 24
            got.append(r.choices[0].text)
    llm = LLM(model=ALIAS, dtype="float32", kv_cache_memory_bytes=128 << 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert got == [o.outputs[0].text for o in outs]
    # the offline base model has no chat template in its GGUF: a clear 400 in OpenAI's format
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "chat template" in str(e.value)
    metrics = metric_values(httpx.get(f"{server.url}/metrics", headers=server.headers).text)
    assert metrics["tokenmill:kv_cache_blocks_slid_out_total"] > 0  # the 700-token prompt slid past the window
    assert server.proc.poll() is None
