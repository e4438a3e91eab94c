"""Reasoning split from replies (entrypoints/openai/reasoning.py), whole and streamed with tags cut anywhere
across deltas; and the grammar that starts a constraint after the reasoning (structured/reasoning.py), walked
token by token with the real tokenizer."""

from __future__ import annotations

import json
import random

import pytest

from tokenmill.entrypoints.openai.chat_output import ReplyFormat, ReplyStream, reply_parts
from tokenmill.entrypoints.openai.reasoning import get_reasoning_parser
from tokenmill.entrypoints.openai.tool_calls import assemble_calls, get_tool_parser
from tokenmill.errors import InvalidRequest
from tokenmill.sampling_params import StructuredOutputs
from tokenmill.structured.grammar import GrammarCompiler
from tokenmill.structured.reasoning import ReasoningFence, after_reasoning

# (parser, reply starts inside the reasoning, reply) -> (reasoning, content)
CASES = [
    ("qwen3", False, '<think>\nParis is big.\n</think>\n\n{"city":"Paris"}', ("Paris is big.", '{"city":"Paris"}')),
    ("qwen3", False, "  <think>a <b> </thin </think>c", ("a <b> </thin", "c")),
    ("qwen3", False, "No thinking here.", (None, "No thinking here.")),
    ("qwen3", False, "I <think> mid-sentence", (None, "I <think> mid-sentence")),
    ("qwen3", False, "<thinking>is not the tag</thinking>", (None, "<thinking>is not the tag</thinking>")),
    ("qwen3", False, "<think>cut short by max_tokens", ("cut short by max_tokens", "")),
    ("qwen3", False, "<think>ends in a partial tag </thi", ("ends in a partial tag </thi", "")),
    ("qwen3", False, "<thi", (None, "<thi")),
    ("qwen3", True, "reasoning the template opened</think>answer", ("reasoning the template opened", "answer")),
    ("qwen3", True, "<think>repeated tag</think>answer", ("repeated tag", "answer")),
    ("deepseek_r1", True, "no start tag</think>\nanswer", ("no start tag", "answer")),
    ("deepseek_r1", True, "never ends", ("never ends", "")),
    ("deepseek_r1", True, "", (None, "")),
    ("qwen3", False, "<think></think>answer", ("", "answer")),
]


def stream_split(name: str, is_open: bool, text: str, seed: int) -> tuple[str | None, str]:
    rng = random.Random(seed)
    s = get_reasoning_parser(name).streamer(is_open)
    reasoning, content, i = "", "", 0
    while i < len(text):
        step = rng.randint(1, 5)
        d = s.feed(text[i : i + step])
        reasoning, content, i = reasoning + d.reasoning, content + d.content, i + step
    d = s.flush()
    return (reasoning + d.reasoning if s.has_reasoning else None), content + d.content


@pytest.mark.parametrize("name,is_open,text,expected", CASES)
def test_split_whole_and_streamed_with_tags_cut_anywhere(name, is_open, text, expected):
    split = get_reasoning_parser(name).split(text, is_open)
    assert (split.reasoning, split.content) == expected
    for seed in range(30):
        assert stream_split(name, is_open, text, seed) == expected, seed


def test_which_replies_start_inside_the_reasoning():
    qwen3, r1 = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")
    assert qwen3.is_open_after("<|im_start|>assistant\n<think>\n")
    assert not qwen3.is_open_after("<|im_start|>assistant\n")
    assert not qwen3.is_open_after("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    assert r1.is_open_after("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("granite")


def test_tool_calls_are_read_only_after_the_reasoning():
    fmt = ReplyFormat(
        reasoning=get_reasoning_parser("qwen3"),
        tools=get_tool_parser("hermes"),
        tool_names=frozenset({"add"}),
    )
    text = (
        '<think>I could write <tool_call>\n{"name": "add", "arguments": {"a": 0}}\n</tool_call> but no.</think>\n'
        'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    parts = reply_parts(fmt, text)
    assert parts.reasoning.startswith("I could write <tool_call>") and parts.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in parts.calls] == [("add", {"a": 1, "b": 2})]
    for seed in range(20):
        rng, s, i = random.Random(seed), ReplyStream(fmt), 0
        reasoning, content, chunks = "", "", []
        while i < len(text):
            step = rng.randint(1, 6)
            d = s.feed(text[i : i + step], i + step >= len(text))
            reasoning, content, chunks, i = reasoning + d.reasoning, content + d.content, chunks + d.chunks, i + step
        assert reasoning == parts.reasoning and content.strip() == parts.content
        assert [(c.name, c.arguments) for c in assemble_calls(chunks)] == [(c.name, c.arguments) for c in parts.calls]
        assert s.num_calls == 1


@pytest.fixture(scope="module")
def compiler(gguf_tokenizer):
    return GrammarCompiler(gguf_tokenizer, gguf_tokenizer.vocab_size, [gguf_tokenizer.eos_token_id])


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def accepts(compiler, gguf_tokenizer, spec: StructuredOutputs, text: str) -> bool:
    m = compiler.matcher(compiler.compile(spec))
    return m.consume(gguf_tokenizer.encode(text, add_special_tokens=False)) and m._m.is_accepting()


@pytest.mark.parametrize(
    "text,is_open,ok",
    [
        ('{"city":"Paris","population":2}', False, True),  # no reasoning block: the body alone
        ('<think>Paris? {"city": oops</think>\n\n{"city":"Paris","population":2}', False, True),
        ("<think>Some thought.</think>not json", False, False),
        ('I think.</think>{"city":"Paris","population":2}', False, False),  # closed: no bare reasoning
        ('I think.</think> {"city":"Paris","population":2}', True, True),
        ('<think>I think.</think>{"city":"Paris","population":2}', True, True),
        ('{"city":"Paris","population":2}', True, False),  # open: that is still reasoning, not done
        ('<think>a</think><think>b</think>{"city":"Paris","population":2}', False, False),  # one block
        ('<think>a</think>{"city":"Paris","population":"2"}', False, False),  # the schema still holds
    ],
)
def test_a_json_schema_applies_only_after_the_reasoning(compiler, gguf_tokenizer, text, is_open, ok):
    spec = after_reasoning(StructuredOutputs(json=SCHEMA), ReasoningFence(is_open=is_open))
    assert accepts(compiler, gguf_tokenizer, spec, text) is ok


def test_every_kind_of_constraint_and_forced_tool_calls_can_follow_reasoning(compiler, gguf_tokenizer):
    think = "<think>Hmm, let me see. {[</think>\n"
    for spec, body in (
        (StructuredOutputs(json_object=True), '{"a":1}'),
        (StructuredOutputs(regex="[a-z]+/[0-9]{2}"), "abc/42"),
        (StructuredOutputs(choice=("yes", "no")), "no"),
        (StructuredOutputs(grammar='start: "x" NUM\nNUM: /[0-9]+/'), "x12"),
        (StructuredOutputs(grammar='root ::= "a" [0-9]'), "a7"),  # GBNF
        (
            StructuredOutputs(grammar=get_tool_parser("hermes").grammar([{"name": "f", "parameters": SCHEMA}], False)),
            '<tool_call>\n{"name":"f","arguments":{"city":"x","population":1}}\n</tool_call>\n',
        ),
    ):
        wrapped = after_reasoning(spec, ReasoningFence())
        assert accepts(compiler, gguf_tokenizer, wrapped, think + body), spec
        assert accepts(compiler, gguf_tokenizer, wrapped, body), spec
        assert not accepts(compiler, gguf_tokenizer, wrapped, think + body + "!"), spec


def test_a_bad_constraint_is_still_named_by_its_own_field():
    with pytest.raises(InvalidRequest) as e:
        after_reasoning(StructuredOutputs(json="{not json"), ReasoningFence())
    assert e.value.param == "structured_outputs.json"
    with pytest.raises(InvalidRequest) as e:
        after_reasoning(StructuredOutputs(regex="(unclosed"), ReasoningFence())
    assert e.value.param == "structured_outputs.regex"
