"""POST /v1/responses, GET and DELETE /v1/responses/{id} through the official `openai` client against the real
server: the same greedy text as chat completions (one engine path), instructions, max_output_tokens, the
streamed event sequence, previous_response_id and store, json_schema output, a function-call round trip, and
bad input as 4xx in OpenAI's error shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL

pytestmark = pytest.mark.slow

QUESTION = "Name a fruit that is yellow."
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int, **kw) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    return r.choices[0].message.content or ""


def test_plain_text_is_chat_completions_greedy_text(client):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text == chat_text(client, [{"role": "user", "content": QUESTION}], 24)
    assert r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_instructions_and_items_are_the_chat_messages(client):
    items = [
        {"role": "user", "content": "Hello!"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi. How can I help?"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    r = client.responses.create(
        model=MODEL, instructions="Answer in one word.", input=items, max_output_tokens=16, temperature=0
    )
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi. How can I help?"},
        {"role": "user", "content": QUESTION},
    ]
    assert r.output_text == chat_text(client, messages, 16)
    assert r.instructions == "Answer in one word."


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    assert r.output[0].status == "incomplete"


def test_stream_events_in_order_and_deltas_join_to_the_text(client):
    full = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=20, temperature=0)
    events = list(
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=20, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    num_deltas = kinds.count("response.output_text.delta")
    # a reader that lags gets the queued deltas merged (engine/async_engine.py), so a count of 1 is
    # possible on a loaded host; that deltas come one per step is tests/engine/test_deltas.py's check
    assert num_deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{full.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if e.type == "response.output_text.delta")
    assert events[-4].text == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == full.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == text  # stored once it finished


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(
        model=MODEL, instructions="Be brief.", input="My name is Ada.", max_output_tokens=16, temperature=0
    )
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input="What is my name?", max_output_tokens=16, temperature=0
    )
    assert second.previous_response_id == first.id
    # instructions are not carried over (OpenAI's rule): the chained prompt has no system message
    messages = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.output_text == chat_text(client, messages, 16)
    assert second.usage.input_tokens > first.usage.input_tokens


def test_get_delete_and_store_false(client, server):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)

    unstored = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0, store=False)
    assert unstored.store is False and unstored.output_text == r.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    resp = httpx.post(
        f"{server.url}/v1/responses",
        headers=server.headers,
        json={"input": "Hi", "previous_response_id": unstored.id, "max_output_tokens": 2},
    )
    assert resp.status_code == 404
    assert resp.json()["error"]["param"] == "previous_response_id"
    assert resp.json()["error"]["code"] == "previous_response_not_found"


def test_json_schema_format_parses_and_validates(client):
    schema = {
        "type": "object",
        # NOTE: a bounded population: unbounded, the 135M model's greedy digits ran to max_output_tokens
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    kw = dict(
        model=MODEL,
        input="The largest city of France and its population, as JSON.",
        max_output_tokens=80,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    )
    r = client.responses.create(**kw)
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    streamed = client.responses.create(**kw, stream=True)
    text = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    assert text == r.output_text


def test_function_call_round_trip(client):
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    forced = {"type": "function", "name": "get_weather"}
    r = client.responses.create(
        model=MODEL, input=[ask], tools=[WEATHER_TOOL], tool_choice=forced, max_output_tokens=60, temperature=0
    )
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert isinstance(args["city"], str)

    # the same call streamed: its item, then its arguments in fragments as the model writes them
    events = list(
        client.responses.create(
            model=MODEL,
            input=[ask],
            tools=[WEATHER_TOOL],
            tool_choice=forced,
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    num_deltas = kinds.count("response.function_call_arguments.delta")
    # a reader that lags gets the queued deltas merged (engine/async_engine.py), so a count of 1 is
    # possible on a loaded host; that deltas come one per step is tests/engine/test_deltas.py's check
    assert num_deltas >= 1
    assert kinds[2:] == [
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * num_deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
    assert deltas == events[-3].arguments == calls[0].arguments

    # send the result back: the function_call item as the client got it, then its output
    result = '{"temperature_c": 21, "sky": "clear"}'
    follow = [
        ask,
        calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": result},
    ]
    r2 = client.responses.create(model=MODEL, input=follow, tools=[WEATHER_TOOL], max_output_tokens=24, temperature=0)
    assert r2.status in ("completed", "incomplete")
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}
    messages = [
        ask,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[0].call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": calls[0].arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": result},
    ]
    same = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[chat_tool], max_tokens=24, temperature=0
    )
    assert r2.output_text == (same.choices[0].message.content or "")

    # and through previous_response_id instead of resending the call
    r3 = client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": result}],
        tools=[WEATHER_TOOL],
        max_output_tokens=24,
        temperature=0,
    )
    assert r3.output_text == r2.output_text


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": 123}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [{"type": "image", "url": "x"}]}, 400, "input"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, 400, "input"),
        ({"input": "hi", "frobnicate": 1}, 400, "frobnicate"),
        ({"input": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "hi", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
        ({"input": "hi", "metadata": {"k": "\ud800"}}, 400, "metadata"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
        (
            {"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
            400,
            "tool_choice",
        ),
        ({"input": "word " * 3000}, 400, "input"),
        ({"input": "hi", "max_output_tokens": 100000}, 400, "max_output_tokens"),
        ({"input": "hi", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
        ({"input": "hi", "model": "no-such-model"}, 404, "model"),
    ],
)
def test_bad_input_is_a_4xx_in_openai_shape(server, body, status, param):
    headers = {**server.headers, "content-type": "application/json"}
    # NOTE: json.dumps escapes a lone surrogate as \ud800 (httpx's json= cannot send one)
    r = httpx.post(f"{server.url}/v1/responses", headers=headers, content=json.dumps(body), timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err


def test_unknown_response_id_is_a_404(server):
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{server.url}/v1/responses/resp_nope", headers=server.headers)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
