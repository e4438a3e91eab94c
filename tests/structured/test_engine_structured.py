"""Structured outputs in the engine, on a tiny random Llama with the real vocabulary: a random model's output
is valid only because of the grammar. JSON schemas, regex, choice, Lark and GBNF grammars; n > 1;
greedy identity with speculation (chain and tree); finish "length" when max_tokens cuts the grammar short;
invalid constraints are errors naming the field, before any state."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequest
from tokenmill.sampling_params import StructuredOutputs

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), max_model_len=512, num_gpu_blocks_override=256, max_num_batched_tokens=64)


def gen(llm, prompts, **kw):
    outs = llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)
    llm.check_integrity()
    return outs


def test_json_schema_outputs_validate_sampled_and_greedy(llm):
    so = StructuredOutputs(json=PERSON)
    sampled = gen(llm, ["Describe a user:"], n=6, temperature=1.0, seed=3, max_tokens=200, structured_outputs=so)[
        0
    ].outputs  # n > 1: each sample has its own matcher
    greedy = gen(llm, ["Describe a user:"], temperature=0, max_tokens=200, structured_outputs=so)[0].outputs
    for c in sampled + greedy:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    assert len({c.text for c in sampled}) > 1  # sampled: not one forced string
    st = llm.stats()
    assert st.num_grammar_masks > 0 and st.num_grammar_violations == 0


def test_without_the_grammar_the_random_model_is_not_json(llm):
    out = gen(llm, ["Describe a user:"], temperature=0, max_tokens=40)[0].outputs[0].text
    with pytest.raises(ValueError):
        json.loads(out)


def test_json_object_regex_choice_and_grammars(llm):
    # NOTE: json_object is tested with the real model (tests/structured/test_server_structured.py): any object
    # is unbounded, and a random model rarely closes one within max_tokens
    pattern = r"[A-Z][a-z]{2,5}-[0-9]{3}"  # NOTE: not \d: the grammar engine's \d is Unicode 16 digits, newer than re's
    for c in gen(
        llm, ["x"], n=4, temperature=1.0, seed=2, max_tokens=30, structured_outputs=StructuredOutputs(regex=pattern)
    )[0].outputs:
        assert re.fullmatch(pattern, c.text), c.text
    choices = ["red", "green", "blue violet"]
    got = {
        c.text
        for c in gen(
            llm,
            ["x"],
            n=8,
            temperature=1.0,
            seed=4,
            max_tokens=10,
            structured_outputs=StructuredOutputs(choice=choices),
        )[0].outputs
    }
    assert got <= set(choices) and got
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
    o = gen(llm, ["x"], temperature=1.0, seed=5, max_tokens=60, structured_outputs=StructuredOutputs(grammar=lark))[
        0
    ].outputs[0]
    assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", o.text), o.text
    gbnf = 'root ::= "yes" | "no" | "maybe"'
    o = gen(llm, ["x"], temperature=1.0, seed=6, max_tokens=10, structured_outputs=StructuredOutputs(grammar=gbnf))[
        0
    ].outputs[0]
    assert o.text in ("yes", "no", "maybe")


def test_mixed_batch_constrained_and_free_rows(llm):
    free = SamplingParams(temperature=0, max_tokens=20)
    alone = gen(llm, ["hello there"], temperature=0, max_tokens=20)[0].outputs[0].token_ids
    outs = llm.generate(
        ["hello there", "Describe a user:"],
        [free, SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputs(json=PERSON))],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].token_ids == alone  # the free row is not touched by the other's mask
    jsonschema.validate(json.loads(outs[1].outputs[0].text), PERSON)


def test_max_tokens_cuts_the_grammar_short_with_finish_length(llm):
    o = gen(llm, ["x"], temperature=1.0, seed=1, max_tokens=3, structured_outputs=StructuredOutputs(json=PERSON))[
        0
    ].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 3


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False, "prompt_lookup_min": 1},
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "adaptive": False,
            "prompt_lookup_min": 1,
            "tree": {"max_nodes": 6, "max_width": 3},
        },
    ],
)
def test_greedy_under_a_grammar_identical_with_speculation(tiny_llama, llm, spec):
    so = StructuredOutputs(json=PERSON)
    prompts = ['{"name": "ab", "age": 3, "role": "user", "tags": []} again: ', "Describe a user:"]
    ref = [o.outputs[0].token_ids for o in gen(llm, prompts, temperature=0, max_tokens=200, structured_outputs=so)]
    spec_llm = LLM(
        model=str(tiny_llama),
        max_model_len=512,
        num_gpu_blocks_override=256,
        max_num_batched_tokens=64,
        speculative_config=spec,
    )
    outs = gen(spec_llm, prompts, temperature=0, max_tokens=200, structured_outputs=so)
    assert [o.outputs[0].token_ids for o in outs] == ref
    st = spec_llm.stats()
    assert st.spec_decode["num_draft_tokens"] > 0 and st.num_grammar_violations == 0
    sampled = gen(spec_llm, ["Describe a user:"] * 4, temperature=1.0, seed=9, max_tokens=200, structured_outputs=so)
    for o in sampled:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


@pytest.mark.parametrize(
    "so, param",
    [
        (dict(json='{"type": "object"'), "structured_outputs.json"),
        (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "structured_outputs.json"),
        (dict(regex="a(b"), "structured_outputs.regex"),
        (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    ],
)
def test_invalid_constraints_are_errors_naming_the_field(llm, so, param):
    with pytest.raises(InvalidRequest) as e:
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=StructuredOutputs(**so)))
    assert e.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_structured_outputs_field_needs_exactly_one_kind():
    with pytest.raises(InvalidRequest):
        StructuredOutputs()
    with pytest.raises(InvalidRequest):
        StructuredOutputs(regex="a", choice=["a"])
