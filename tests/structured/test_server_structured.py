"""Structured outputs through the real server with the `openai` client: 50 generated JSON schemas (nesting,
enums, arrays, numbers) answered by a tiny random model, every reply parsed and validated with jsonschema,
streaming and not, with n-gram speculation on and off; vLLM's extra fields; bad constraints are 400s."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, metric_values, start_server

ARGS = (
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "16",
    "--max-num-batched-tokens",
    "256",
    "--kv-cache-memory-bytes",
    str(64 << 20),
)
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})


def make_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random schema whose every instance is short: bounded strings, arrays and integers."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] * 2 if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 10)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 1000}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "amber", 1, 2, None, True], rng.randint(1, 4))}
    if kind == "array":
        return {
            "type": "array",
            "items": make_schema(rng, depth + 1),
            "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 3),
        }
    props = {f"k{i}_{rng.randint(0, 99)}": make_schema(rng, depth + 1) for i in range(rng.randint(1, 4))}
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


def schemas(n: int = 50) -> list[dict]:
    rng = random.Random(2026)
    return [
        {
            "type": "object",
            "properties": {"answer": make_schema(rng), "id": {"type": "integer", "minimum": 0, "maximum": 9999}},
            "required": ["answer", "id"],
            "additionalProperties": False,
        }
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("structured")
    plain = start_server(tmp, *ARGS, "--model", str(tiny_llama))
    spec = start_server(tmp, *ARGS, "--model", str(tiny_llama), "--speculative-config", SPEC)
    real = start_server(tmp, *ARGS)  # the default 135M model: an instruct model closes its JSON objects
    yield {"plain": plain, "spec": spec, "real": real}
    for srv in (plain, spec, real):
        srv.stop()


async def answer(client: openai.AsyncOpenAI, schema: dict, i: int, stream: bool) -> tuple[str, str]:
    kw = dict(
        model=client.model,
        max_tokens=300,
        temperature=1.0,
        seed=i,
        messages=[{"role": "user", "content": f"Fill in record {i}."}],
        response_format={"type": "json_schema", "json_schema": {"name": f"r{i}", "schema": schema, "strict": True}},
    )
    if not stream:
        r = await client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = [], None
    async for chunk in await client.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    return "".join(text), reason


async def run_all(url: str, cases: list[tuple[int, dict, bool]]) -> list[tuple[str, str]]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as client:
        client.model = (await client.models.list()).data[0].id
        return await asyncio.gather(*(answer(client, s, i, stream) for i, s, stream in cases))


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_fifty_schemas_validate_streaming_and_not(servers, which):
    all_schemas = schemas()
    picked = list(enumerate(all_schemas)) if which == "plain" else list(enumerate(all_schemas))[::5]
    cases = [(i, s, i % 2 == 0) for i, s in picked]
    results = asyncio.run(run_all(servers[which].url, cases))
    for (i, schema, stream), (text, reason) in zip(cases, results):
        assert reason == "stop", f"schema {i} (stream={stream}): {reason}: {text!r}"
        jsonschema.validate(json.loads(text), schema)
    if which == "spec":  # speculation ran on these requests
        m = metric_values(httpx.get(servers[which].url + "/metrics").text)
        assert m["tokenmill:spec_decode_num_draft_tokens_total"] > 0


def test_vllm_extra_fields_and_json_object(servers):
    client = openai.OpenAI(base_url=f"{servers['plain'].url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "pick"}]
    r = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=10, extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}}
    )
    assert r.choices[0].message.content in ("alpha", "beta")
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, extra_body={"guided_regex": r"\d{4}"})
    assert len(r.choices[0].message.content) == 4 and r.choices[0].message.content.isdigit()
    r = client.completions.create(
        model=model,
        prompt="x",
        max_tokens=200,
        temperature=1.0,
        seed=1,
        extra_body={
            "guided_json": {
                "type": "object",
                "properties": {"a": {"type": "boolean"}},
                "required": ["a"],
                "additionalProperties": False,
            }
        },
    )
    assert isinstance(json.loads(r.choices[0].text)["a"], bool)
    r = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=4, temperature=1.0, seed=2, response_format={"type": "json_object"}
    )
    assert r.choices[0].finish_reason == "length"  # cut short, as OpenAI does


def test_json_object_with_the_real_model(servers):
    client = openai.OpenAI(base_url=f"{servers['real'].url}/v1", api_key=API_KEY, max_retries=0)
    msgs = [{"role": "user", "content": "Give the capital and population of France as a JSON object."}]
    for stream in (False, True):
        kw = dict(
            model="smollm2-135m", messages=msgs, max_tokens=200, temperature=0, response_format={"type": "json_object"}
        )
        if stream:
            text = "".join(
                c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True) if c.choices
            )
        else:
            r = client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].message.content
        assert isinstance(json.loads(text), dict), text
    free = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=60, temperature=0)
    with pytest.raises(ValueError):  # unconstrained, the same model answers in prose
        json.loads(free.choices[0].message.content)


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}},
                    },
                }
            },
            "structured_outputs.json",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)
def test_bad_constraints_are_400s_naming_the_problem(servers, body, param):
    client = openai.OpenAI(base_url=f"{servers['plain'].url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5, extra_body=body
        )
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param, err
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert r.choices[0].message.content is not None  # the server goes on serving


# --- tool calling (the default model's ChatML has no tool format: tools in the system prompt, Hermes tags) ----

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def test_tool_call_round_trip_with_the_openai_client(servers):
    client = openai.OpenAI(base_url=f"{servers['real'].url}/v1", api_key=API_KEY, max_retries=0)
    r = client.chat.completions.create(
        model="smollm2-135m", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", max_tokens=120, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        schema = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert call.id.startswith("call_") and call.type == "function"
    call = choice.message.tool_calls[0]
    # the client runs the tool and sends the result back; the model answers in prose (tool_choice auto)
    follow = ASK + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})},
    ]
    r2 = client.chat.completions.create(
        model="smollm2-135m", messages=follow, tools=[WEATHER, ADD], max_tokens=60, temperature=0
    )
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.choices[0].message.content or r2.choices[0].message.tool_calls


def test_named_tool_choice_streams_tool_call_deltas(servers):
    client = openai.OpenAI(base_url=f"{servers['real'].url}/v1", api_key=API_KEY, max_retries=0)
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Add 19 and 23."}],
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=80,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = entry["id"] or tc.id
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons == ["tool_calls"] and list(calls) == [0]  # named choice: one call, of that function
    assert calls[0]["name"] == "add" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), ADD["function"]["parameters"])


def test_tool_choice_none_and_bad_tool_requests(servers):
    client = openai.OpenAI(base_url=f"{servers['real'].url}/v1", api_key=API_KEY, max_retries=0)
    r = client.chat.completions.create(
        model="smollm2-135m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=30, temperature=0
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    for kw, param in (
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools.0.function.name"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2-135m", messages=ASK, max_tokens=5, **kw)
        assert e.value.body["param"] == param, e.value.body


# A chat template with its own tool format (it reads `tools`, as Qwen2.5/3's and Llama 3.x's do). Written for
# this test in the Hermes shape; the server must hand it the tools instead of writing its own system block.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nFunctions you can call, one JSON object per line:\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n"
    'Answer a call as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n{%- endif %}'
    "{%- for m in messages %}\n<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}\n</tool_call>'
    "{%- endfor %}{%- endif %}<|im_end|>{%- endfor %}"
    "{%- if add_generation_prompt %}\n<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def tool_template_server(tmp_path_factory, tiny_llama):
    import shutil

    path = tmp_path_factory.mktemp("tool_template") / "model"
    shutil.copytree(tiny_llama, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TOOL_TEMPLATE}))
    srv = start_server(tmp_path_factory.mktemp("tool_template_srv"), *ARGS, "--model", str(path))
    yield srv, path
    srv.stop()


def test_a_template_with_a_tool_format_renders_the_tools_itself(tool_template_server):
    from tokenmill.models.loader import HFDirSource

    srv, path = tool_template_server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120, temperature=1.0, seed=3
    )
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # the prompt is exactly the template's own rendering of the tools (not our system-prompt block)
    tok = HFDirSource(path).tokenizer()
    assert tok.template_renders_tools
    expected = tok.encode(tok.apply_chat_template(ASK, tools=[WEATHER]), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(expected)
    follow = ASK + [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
    ]
    r2 = client.chat.completions.create(
        model=model, messages=follow, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    )
    assert r2.choices[0].message.tool_calls is None
