"""The Hermes-style tool-call format (entrypoints/openai/tool_calls.py): parsing whole replies and streams, and
the grammar that constrains tool_choice "required" / a named function."""

from __future__ import annotations

import json
import random

import llguidance

from tokenmill.entrypoints.openai.tool_calls import (
    StreamingToolParser,
    parse_reply,
    tool_call_grammar,
    tools_system_prompt,
)

REPLY = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>\n'
    "<tool_call>not json</tool_call> done"
)


def test_parse_reply_splits_prose_and_calls():
    r = parse_reply(REPLY)
    assert [(c.name, json.loads(c.arguments)) for c in r.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert r.content == "Let me check.\n<tool_call>not json</tool_call> done"  # a bad block stays text
    assert len({c.id for c in r.calls}) == 2
    assert parse_reply("no calls here").calls == [] and parse_reply("").content is None


def test_streaming_parser_gives_the_same_calls_and_prose_in_any_chunking():
    whole = parse_reply(REPLY)
    rng = random.Random(0)
    for _ in range(20):
        p, prose, calls, i = StreamingToolParser(), "", [], 0
        while i < len(REPLY):
            step = rng.randint(1, 7)
            text, got = p.feed(REPLY[i : i + step])
            prose += text
            calls += got
            i += step
        prose += p.flush()
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
        assert "<tool_call>\n{" not in prose and prose.startswith("Let me check.") and prose.endswith(" done")


def test_grammar_accepts_the_format_the_parser_reads():
    fns = [
        {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        }
    ]
    grammar = llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(fns, parallel=True))
    assert llguidance.LLMatcher.validate_grammar_with_warnings(grammar) == (False, [])
    assert "get_weather" in tools_system_prompt([{"type": "function", "function": fns[0]}])
