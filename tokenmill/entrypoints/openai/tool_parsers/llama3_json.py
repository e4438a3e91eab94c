"""llama3_json: Llama 3.1-3.3's JSON calls, the whole reply (no tags around them):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": {...}}

The optional <|python_tag|> first (a special token, so usually decoded away), calls separated by ";" (vLLM's
reading of several calls). A reply that does not start with "{" (or the tag) is prose. Only the functions
offered count as calls, so a JSON answer with a "name" key stays content; text after the last call is content.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.entrypoints.openai.tool_calls import CutCalls, ToolDeltas, call_arguments
from tokenmill.entrypoints.openai.tool_parsers.hermes import calls_schema, max_calls
from tokenmill.entrypoints.openai.tool_parsers.json_calls import JsonCallStream

PYTHON_TAG = "<|python_tag|>"
ARGS_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser:
    name = "llama3_json"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        sigs = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return (
            "Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
            "value}. Do not use variables.\n\n"
            f"{sigs}"
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(
            json.dumps(
                {"name": c["function"]["name"], "parameters": call_arguments(c["function"].get("arguments"))},
                ensure_ascii=False,
            )
            for c in calls
        )

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        n = max_calls(functions, parallel)
        more = f' ("; " call){{0,{n - 1}}}' if n > 1 else ""
        return f"start: call{more}\ncall: %json {json.dumps(calls_schema(functions, 'parameters'))}\n"

    def streamer(self, tool_names: frozenset[str]) -> Llama3JsonStreamer:
        return Llama3JsonStreamer(tool_names)


class Llama3JsonStreamer:
    """HEAD (whitespace, or a prefix of <|python_tag|>) -> CALLS (one JsonCallStream after another, between
    them whitespace and ";") -> CONTENT (what is not a call, to the end)."""

    _HEAD, _CALLS, _CONTENT = range(3)

    def __init__(self, tool_names: frozenset[str]) -> None:
        self.tool_names = tool_names
        self.state = self._HEAD
        self.buf = ""
        self.call: JsonCallStream | None = None
        self.num_calls = 0

    def feed(self, delta: str) -> ToolDeltas:
        self.buf += delta
        out = ToolDeltas()
        while True:
            if self.state == self._HEAD:
                head = self.buf.lstrip()
                if head.startswith(PYTHON_TAG):
                    head = head[len(PYTHON_TAG) :].lstrip()
                elif not head or PYTHON_TAG.startswith(head):
                    return out
                if not head:
                    return out
                self.state = self._CALLS if head.startswith("{") else self._CONTENT
                if self.state == self._CALLS:
                    self.buf = head
            elif self.state == self._CALLS:
                if self.call is None:
                    rest = self.buf.lstrip()
                    if rest.startswith(";") and self.num_calls:
                        rest = rest[1:].lstrip()
                    if not rest:
                        return out
                    if not rest.startswith("{"):
                        self.buf = rest
                        self.state = self._CONTENT
                        continue
                    self.buf = rest
                    self.call = JsonCallStream(self.num_calls, ARGS_KEYS, self.tool_names)
                out += self.call.feed(self.buf)
                if self.call.is_bad:
                    self.call = None
                    self.state = self._CONTENT  # NOTE: the object and all after it are content
                    continue
                if self.call.end is None:
                    return out
                self.buf = self.buf[self.call.end :]
                self.call = None
                self.num_calls += 1
            else:
                out.prose += self.buf
                self.buf = ""
                return out

    def flush(self) -> ToolDeltas:
        rest, self.buf = self.buf, ""
        if self.call is not None and self.call.is_streaming:
            return ToolDeltas(cut=CutCalls(self.num_calls, rest))
        if self.state == self._CALLS and self.num_calls:
            return ToolDeltas(prose=rest.lstrip().removeprefix(";"))
        return ToolDeltas(prose=rest)
