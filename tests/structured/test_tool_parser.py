"""The tool-call formats (entrypoints/openai/tool_parsers/): hermes, llama3_json and pythonic, parsed whole and
streamed in any chunking (the same calls either way, arguments as fragments), malformed input kept as content,
the grammars that force calls accepted token by token and read back by their own parser, and the format read
off a chat template."""

from __future__ import annotations

import json
import random

import llguidance
import pytest

from tokenmill.entrypoints.openai.tool_calls import (
    ToolDeltas,
    assemble_calls,
    detect_tool_parser,
    get_tool_parser,
    parse_reply,
)

NAMES = frozenset({"get_weather", "add"})
WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ADD = {
    "name": "add",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}

HERMES_REPLY = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>\n'
    "<tool_call>not json</tool_call> done"
)
LLAMA3_REPLY = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris, \\"FR\\" {x}"}}; '
    '{"name": "add", "parameters": {"a": 1, "b": 2}}'
)
PYTHONIC_REPLY = "[get_weather(city='Pa,ris', unit=\"C\"), add(a=1, b=-2)]"


def stream(parser_name: str, text: str, seed: int, max_step: int = 7) -> ToolDeltas:
    rng = random.Random(seed)
    s = get_tool_parser(parser_name).streamer(NAMES)
    out, i = ToolDeltas(), 0
    while i < len(text):
        step = rng.randint(1, max_step)
        out += s.feed(text[i : i + step])
        i += step
    out += s.flush()
    return out


def whole(parser_name: str, text: str):
    return parse_reply(get_tool_parser(parser_name), text, NAMES)


def calls_of(reply) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in reply.calls]


def test_hermes_splits_prose_and_calls_and_keeps_a_bad_block_as_text():
    r = whole("hermes", HERMES_REPLY)
    assert calls_of(r) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert r.content == "Let me check.\n<tool_call>not json</tool_call> done"
    assert r.calls[0].arguments == '{"city": "Paris"}'  # the model's own text
    assert len({c.id for c in r.calls}) == 2 and all(c.id.startswith("call_") for c in r.calls)
    assert whole("hermes", "no calls here").calls == [] and whole("hermes", "").content is None


def test_llama3_json_reads_calls_separated_by_semicolons_after_the_python_tag():
    r = whole("llama3_json", LLAMA3_REPLY)
    assert calls_of(r) == [("get_weather", {"city": 'Paris, "FR" {x}'}), ("add", {"a": 1, "b": 2})]
    assert r.content is None
    r = whole("llama3_json", '{"name": "add", "arguments": {"a": 1, "b": 2}}\nDone.')
    assert calls_of(r) == [("add", {"a": 1, "b": 2})] and r.content == "Done."


def test_pythonic_reads_a_list_of_calls_with_literal_arguments():
    r = whole("pythonic", PYTHONIC_REPLY)
    assert calls_of(r) == [("get_weather", {"city": "Pa,ris", "unit": "C"}), ("add", {"a": 1, "b": -2})]
    assert r.calls[0].arguments == '{"city": "Pa,ris", "unit": "C"}'
    r = whole("pythonic", '[get_weather(city="x", extra=[1, {"k": None}, true])] trailing')
    assert calls_of(r) == [("get_weather", {"city": "x", "extra": [1, {"k": None}, True]})]
    assert r.content == "trailing"


MALFORMED = [  # (format, reply, whether a stream has sent the call's head before the text breaks)
    ("hermes", "<tool_call>not json</tool_call>", False),
    ("hermes", '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', False),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', False),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}', True),  # never closed
    ("llama3_json", '{"name": "Paris", "population": 2100000}', False),  # a JSON answer, not a call
    ("llama3_json", '{"name": "unknown_fn", "parameters": {}}', False),  # not an offered function
    ("llama3_json", '{"name": "add", "parameters": {"a": 1', True),
    ("llama3_json", "Sure, here it is: {}", False),
    ("pythonic", "[1] is a footnote", False),
    ("pythonic", "[os.system(cmd='ls')]", False),
    ("pythonic", "[nope(a=1), get_weather(city='x')]", False),
    ("pythonic", "[get_weather('Paris')]", True),  # positional
    ("pythonic", "[get_weather(city=open('x'))]", True),  # not a literal: never evaluated
    ("pythonic", "[get_weather(city='Paris'", True),
    ("pythonic", "[get_weather(city='x'), nope(a=1)]", True),
]


@pytest.mark.parametrize("parser_name,text,is_head_out", MALFORMED)
def test_malformed_calls_are_content_never_an_error(parser_name, text, is_head_out):
    r = whole(parser_name, text)
    assert r.calls == [] and r.content == text.strip()
    for seed in range(5):
        out = stream(parser_name, text, seed)
        if not is_head_out:  # nothing goes out as a call before it is known to be one, however it is chunked
            assert out.chunks == [] and out.prose.strip() == text.strip(), (seed, out)
        else:  # NOTE: a stream cannot take back a call whose head went out; it ends where the text broke
            assert out.chunks[0].name is not None


@pytest.mark.parametrize(
    "parser_name,text",
    [
        ("hermes", HERMES_REPLY),
        ("hermes", '<tool_call>\n{"arguments": {"a": 1, "b": 2}, "name": "add"}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [1, "]}\\"", {}]}}\n</tool_call>x'),
        ("llama3_json", LLAMA3_REPLY),
        ("llama3_json", '  {"name": "add", "parameters": {"a": 1, "b": 2}} ; {"name": "add", "parameters": {}} ok'),
        ("pythonic", PYTHONIC_REPLY),
        ("pythonic", "[add(a=1, b=2), get_weather()]\n"),
        ("pythonic", "plain prose"),
    ],
)
def test_streaming_gives_the_whole_reply_calls_in_any_chunking(parser_name, text):
    ref = whole(parser_name, text)
    for seed in range(40):
        out = stream(parser_name, text, seed, max_step=1 + seed % 9)
        got = assemble_calls(out.chunks)
        assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in ref.calls], seed
        assert (out.prose.strip() or None) == ref.content, seed


def test_a_streamed_call_is_a_head_then_argument_fragments_in_openai_shape():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    s = get_tool_parser("hermes").streamer(NAMES)
    chunks = []
    for i in range(0, len(text), 4):
        chunks += s.feed(text[i : i + 4]).chunks
    chunks += s.flush().chunks
    head, *frags = [c.to_dict() for c in chunks]
    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("call_")
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert len(frags) > 3  # the arguments as the model writes them, not one piece at the end
    assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in frags)
    assert "".join(f["function"]["arguments"] for f in frags) == '{"city": "Paris", "unit": "C"}'

    s = get_tool_parser("pythonic").streamer(NAMES)
    pieces = [s.feed(p) for p in ["[add(", "a=1", ", b=", "2)", ", get_weather(city='x')]"]]
    args = [[c.arguments for c in p.chunks] for p in pieces]
    assert [c.name for c in pieces[0].chunks] == ["add"] and args[1:4] == [[], ['{"a": 1'], [', "b": 2}']]
    assert [(c.index, c.name, c.arguments) for c in pieces[4].chunks][1:] == [(1, None, '{"city": "x"}')]


def _accepts(tok, compiled_grammar: str, text: str) -> bool:
    lt = llguidance.LLTokenizer(tok.hf.to_str(), n_vocab=tok.vocab_size, eos_token=[tok.eos_token_id])
    m = llguidance.LLMatcher(lt, compiled_grammar, log_level=0)
    return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()


@pytest.mark.parametrize(
    "parser_name,forced",
    [
        (
            "hermes",
            '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>\n',
        ),
        (
            "llama3_json",
            '{"name":"get_weather","parameters":{"city":"Paris","unit":"C"}}; '
            '{"name":"add","parameters":{"a":1,"b":2}}',
        ),
        ("pythonic", '[get_weather(city="Paris", unit="F"), add(a=1, b=2)]'),
    ],
)
def test_each_forcing_grammar_accepts_what_its_parser_reads(gguf_tokenizer, parser_name, forced):
    parser = get_tool_parser(parser_name)
    grammar = llguidance.LLMatcher.grammar_from_lark(parser.grammar([WEATHER, ADD], parallel=True))
    assert _accepts(gguf_tokenizer, grammar, forced)
    assert [c.name for c in whole(parser_name, forced).calls] == ["get_weather", "add"]
    one = llguidance.LLMatcher.grammar_from_lark(parser.grammar([WEATHER, ADD], parallel=False))
    assert not _accepts(gguf_tokenizer, one, forced)  # parallel off: one call only
    bad = forced.replace('"Paris"', "3", 1)  # arguments outside the schema
    assert not _accepts(gguf_tokenizer, grammar, bad)


def test_system_prompts_and_rendered_calls_are_in_each_format():
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    tool = {"type": "function", "function": ADD}
    for name, rendered in (
        ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
        ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}'),
        ("pythonic", "[add(a=1, b=2)]"),
    ):
        parser = get_tool_parser(name)
        assert parser.render_calls([call]) == rendered
        assert calls_of(whole(name, rendered)) == [("add", {"a": 1, "b": 2})]
        assert '"add"' in parser.system_prompt([tool])


def test_the_format_is_read_off_the_chat_template():
    assert detect_tool_parser(None).name == "hermes"
    assert detect_tool_parser("{{ messages }}").name == "hermes"  # no tool format: our system-prompt block
    assert detect_tool_parser("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    llama3 = '{% if tools %}Respond in the format {"name": function name, "parameters": dictionary}{% endif %}'
    assert detect_tool_parser(llama3).name == "llama3_json"
    assert detect_tool_parser("{% if tools %}<|python_tag|>{% endif %}").name == "llama3_json"
    pythonic = "{% if tools %}[func_name1(params_name1=params_value1), func_name2(params)]{% endif %}"
    assert detect_tool_parser(pythonic).name == "pythonic"
    unknown = detect_tool_parser("{% for t in tools %}{{ t }}{% endfor %}")
    assert unknown.name == "hermes" and "no known call format" in unknown.why
    with pytest.raises(ValueError, match="hermes, llama3_json, pythonic"):
        get_tool_parser("mistral")
