"""--reasoning-parser against the real server with the real 135M model, through the `openai` and `anthropic`
clients: reasoning_content in chat completions (and delta.reasoning_content streamed), reasoning items in the
Responses API, thinking blocks in the Messages API; a json_schema or a forced tool call constrains only what
follows the reasoning.

What makes the model reason: a chat template written for this test opens the reasoning in the prompt, as
Qwen3-style templates do (the generation prompt ends with "<think>"), and the system prompt shows one example
of reasoning closed by "</think>" and then the answer. SmolLM2-135M never writes think tags on its own; with
that example it writes a sentence of reasoning, "</think>", then the answer (greedy). So these tests prove the
serving path end to end (the split, the grammar that starts after "</think>", the three APIs' shapes, streamed
and not), not that any model reasons well; tests/structured/test_reasoning.py checks the parser on text with
tags cut anywhere, and the grammar token by token.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.server.conftest import DEFAULT_ARGS, MODEL, start_server

pytestmark = pytest.mark.slow

THINK_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>{%- endif %}"
)
SYSTEM = (
    "You first think briefly between <think> and </think>, then answer.\nExample:\n"
    'user: What is the capital of Italy?\nassistant: <think>Italy\'s capital is Rome.</think>{"city": "Rome"}'
)
ASK = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning")
    template = tmp / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    srv = start_server(tmp, *DEFAULT_ARGS, "--reasoning-parser", "qwen3", "--chat-template", str(template))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(oai):
    """The non-streamed chat reply with the json_schema: what every other shape must say."""
    r = oai.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=80, temperature=0, response_format=JSON_FORMAT
    )
    return r.choices[0]


def test_chat_splits_the_reasoning_and_the_schema_applies_only_after_it(server, reference):
    msg = reference.model_dump()["message"]
    reasoning, content = msg["reasoning_content"], msg["content"]
    assert reference.finish_reason == "stop"
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    with pytest.raises(json.JSONDecodeError):
        json.loads(reasoning)  # free prose: the schema did not constrain the reasoning...
    jsonschema.validate(json.loads(content), SCHEMA)  # ...only what follows it
    assert "chat replies: tool calls read as hermes" in server.log() and "reasoning split by qwen3" in server.log()


def test_streamed_reasoning_content_joins_to_the_same_split(oai, reference):
    stream = oai.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=80, temperature=0, response_format=JSON_FORMAT, stream=True
    )
    kinds, reasoning, content = [], "", ""
    for chunk in stream:
        d = chunk.choices[0].delta.model_dump()
        if d.get("reasoning_content"):
            reasoning += d["reasoning_content"]
            kinds.append("reasoning")
        if d.get("content"):
            content += d["content"]
            kinds.append("content")
    msg = reference.model_dump()["message"]
    assert reasoning == msg["reasoning_content"] and content == msg["content"]
    # a reader that lags gets the queued deltas merged (engine/async_engine.py), so a count of 1 is
    # possible on a loaded host; that deltas come one per step is tests/engine/test_deltas.py's check
    assert kinds.count("reasoning") >= 1 and kinds.count("content") >= 1
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # all the reasoning first


def test_a_forced_tool_call_comes_after_the_reasoning(oai):
    system = (
        "You first think briefly between <think> and </think>, then call a tool.\nExample:\n"
        "user: What is the weather in Rome?\nassistant: <think>I need the weather in Rome.</think>\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
    kw = dict(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "What is the weather in Paris?"}],
        tools=[weather],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    r = oai.chat.completions.create(**kw).choices[0]
    assert r.finish_reason == "tool_calls" and len(r.message.tool_calls) == 1
    assert r.model_dump()["message"]["reasoning_content"] and r.message.content is None
    jsonschema.validate(json.loads(r.message.tool_calls[0].function.arguments), SCHEMA)
    reasoning, heads, args = "", [], ""
    for chunk in oai.chat.completions.create(**kw, stream=True):
        d = chunk.choices[0].delta
        reasoning += d.model_dump().get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            assert not heads or reasoning  # the reasoning came first
            if tc.id:
                heads.append((tc.index, tc.function.name))
            args += tc.function.arguments or ""
    assert reasoning == r.model_dump()["message"]["reasoning_content"]
    assert heads == [(0, "get_weather")] and args == r.message.tool_calls[0].function.arguments


def test_responses_api_has_a_reasoning_item_streamed_as_reasoning_text(oai, reference):
    kw = dict(
        model=MODEL,
        instructions=SYSTEM,
        input="What is the capital of France?",
        max_output_tokens=80,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}},
    )
    r = oai.responses.create(**kw)
    msg = reference.model_dump()["message"]
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].type == "reasoning_text"
    assert r.output[0].content[0].text == msg["reasoning_content"] and r.output[0].status == "completed"
    assert r.output_text == msg["content"]

    events = list(oai.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    n_reasoning, n_text = kinds.count("response.reasoning_text.delta"), kinds.count("response.output_text.delta")
    # a reader that lags gets the queued deltas merged (engine/async_engine.py), so a count of 1 is
    # possible on a loaded host; that deltas come one per step is tests/engine/test_deltas.py's check
    assert n_reasoning >= 1 and n_text >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * n_reasoning,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n_text,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == msg["reasoning_content"] == events[4 + n_reasoning].text
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == msg["content"]


def test_messages_api_thinking_blocks_when_thinking_is_enabled(server, reference):
    client = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=120)
    kw = dict(
        model=MODEL,
        max_tokens=80,
        system=SYSTEM,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
    )
    msg = reference.model_dump()["message"]
    m = client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == msg["reasoning_content"] and m.content[1].text == msg["content"]
    plain = client.messages.create(**kw)  # no thinking asked: no thinking block (the text stays clean)
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == msg["content"]

    events = list(client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024}, stream=True))
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == msg["reasoning_content"]
    assert "".join(d.text for d in deltas if d.type == "text_delta") == msg["content"]
    with client.messages.stream(**kw, thinking={"type": "adaptive"}) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", msg["reasoning_content"]),
        ("text", msg["content"]),
    ]
    n = client.messages.count_tokens(
        model=MODEL, messages=kw["messages"], system=SYSTEM, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
