"""A constraint that starts where the model's reasoning ends: one grammar, so the engine needs nothing new.

A reasoning model writes its thoughts between tags before it answers; a JSON schema, regex, choice, grammar
or forced tool call constrains the answer only. after_reasoning turns a constraint into a composite grammar
(llguidance's top-level form, two grammars, the second the original constraint unchanged):

    closed (the output may open a reasoning block):   start: (START reasoning_end AFTER?)? @body
    open   (the prompt already wrote the start tag):  start: START? reasoning_end AFTER? @body

    reasoning_end is one lazy lexeme, `(.|\\n)*` then the end tag: it ends at the first end tag, so the
    reasoning is free text (tags and JSON included) and the constraint starts right after it.

    "<think>a {x</think>\\n{"city":"Paris"}"  closed: reasoning "a {x", AFTER "\\n", body {"city":"Paris"}
    "{"city":"Paris"}"                         closed: no reasoning block, body only
    "a {x</think>{"city":"Paris"}"             open:   reasoning "a {x" (the template wrote "<think>")

A reasoning block that never ends keeps the request in it until max_tokens (finish_reason "length"), as an
unconstrained reasoning model would; the body's own rules are untouched (the JSON stays compact).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenmill.errors import InvalidRequest
from tokenmill.sampling_params import StructuredOutputs
from tokenmill.structured.grammar import grammar_text, is_llguidance_json


@dataclass(frozen=True)
class ReasoningFence:
    """Where reasoning starts and ends in the output text."""

    start: str = "<think>"
    end: str = "</think>"
    is_open: bool = False
    """The output begins inside the reasoning (the prompt ended with `start`, or the model never writes it)."""

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("a reasoning fence needs non-empty start and end tags")


def fence_grammar(fence: ReasoningFence) -> str:
    """The Lark grammar of the reasoning part; `@body` is the constraint that follows it."""
    start, end = json.dumps(fence.start), json.dumps(fence.end)
    head = "START? reasoning_end AFTER?" if fence.is_open else "(START reasoning_end AFTER?)?"
    return (
        f"start: {head} @body\n"
        f"START: {start}\n"
        f"reasoning_end[lazy]: REASONING_TEXT {end}\n"
        "REASONING_TEXT: /(.|\\n)*/\n"
        "AFTER: /[ \\t\\r\\n]+/\n"
    )


def after_reasoning(spec: StructuredOutputs, fence: ReasoningFence) -> StructuredOutputs:
    """`spec` applied after the reasoning block (see the module docstring). Builds and checks the body's grammar
    now, so a bad constraint is an InvalidRequest naming its own field (structured_outputs.json, ...)."""
    import llguidance

    body = grammar_text(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(body)
    if is_error:  # NOTE: checked here, so the error names the request's field, not the composite grammar
        param = f"structured_outputs.{spec.kinds()[0]}"
        raise InvalidRequest(f"{param}: {messages[0] if messages else 'invalid grammar'}", param)
    if is_llguidance_json(body):
        grammars = json.loads(body)["grammars"]
        grammars[0] = {**grammars[0], "name": "body"}
    else:
        grammars = [{"name": "body", "lark_grammar": body}]
    top = {"grammars": [{"name": "reasoning", "lark_grammar": fence_grammar(fence)}, *grammars]}
    return StructuredOutputs(grammar=json.dumps(top, ensure_ascii=False))
