"""Tool calling for chat templates without a tool format of their own (the default model's ChatML): the tools
go into the system prompt and the model answers a call as JSON between tags, as Hermes and Qwen2.5 do:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The parser below and the grammar for tool_choice "required" or a named function agree on that format: the
grammar is Lark with llguidance's `%json` (each call's object constrained by its function's parameter schema),
so a constrained call always parses. With "auto" the model may answer in prose or call; its text is parsed.
A template that renders `tools` itself (it mentions the variable) gets them through the template instead.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments object as JSON text (what OpenAI sends in function.arguments)."""
    id: str

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            d["index"] = index
        return d


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    """The text outside the tool-call blocks (None when there is none)."""
    calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The system-prompt block that tells a template-less model which functions it may call and how."""
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{sigs}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        f"within {TOOL_OPEN}{TOOL_CLOSE} XML tags:\n{TOOL_OPEN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        f"{TOOL_CLOSE}"
    )


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_grammar(functions: list[dict[str, Any]], parallel: bool) -> str:
    """Lark (llguidance) for one tool-call block (with `parallel`: up to one per function), each a call of one
    of `functions`, its arguments constrained by that function's parameter schema."""
    schema = call_schema(functions[0]) if len(functions) == 1 else {"anyOf": [call_schema(f) for f in functions]}
    schema["x-guidance"] = {"whitespace_flexible": False}  # compact JSON, as the parser and clients expect
    # NOTE: at most one call per function offered: a small model told "one or more" repeats its call forever
    repeat = f"{{1,{len(functions)}}}" if parallel and len(functions) > 1 else ""
    return f'start: call{repeat}\ncall: "{TOOL_OPEN}\\n" body "\\n{TOOL_CLOSE}\\n"\nbody: %json {json.dumps(schema)}\n'


def parse_reply(text: str) -> ParsedReply:
    """Split a reply into its prose and its complete tool-call blocks; a block that does not parse as a call
    stays in the prose (the client sees what the model wrote)."""
    calls: list[ToolCall] = []
    prose: list[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_OPEN, pos)
        if start < 0:
            prose.append(text[pos:])
            break
        end = text.find(TOOL_CLOSE, start)
        if end < 0:
            prose.append(text[pos:])
            break
        call = _parse_call(text[start + len(TOOL_OPEN) : end])
        if call is None:
            prose.append(text[pos : end + len(TOOL_CLOSE)])
            pos = end + len(TOOL_CLOSE)
        else:
            prose.append(text[pos:start])
            calls.append(call)
            pos = end + len(TOOL_CLOSE)
            while text.startswith("\n", pos):  # the newline that ends a block belongs to it
                pos += 1
    content = "".join(prose).strip()
    return ParsedReply(content or None, calls)


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments already as text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


class StreamingToolParser:
    """Feeds on a reply's text deltas; hands back the prose to stream now and each tool call once its block is
    complete (OpenAI's delta shape: one tool_calls entry per call with its name and whole arguments). Text that
    might be the start of TOOL_OPEN is held back until it is not."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        prose: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                end = self._buf.find(TOOL_CLOSE)
                if end < 0:
                    break
                call = _parse_call(self._buf[:end])
                if call is None:
                    prose.append(TOOL_OPEN + self._buf[: end + len(TOOL_CLOSE)])
                else:
                    calls.append(call)
                self._buf = (
                    self._buf[end + len(TOOL_CLOSE) :].lstrip("\n") if call else self._buf[end + len(TOOL_CLOSE) :]
                )
                self._in_call = False
                continue
            start = self._buf.find(TOOL_OPEN)
            if start >= 0:
                prose.append(self._buf[:start])
                self._buf = self._buf[start + len(TOOL_OPEN) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buf, TOOL_OPEN)
            prose.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            break
        self.num_calls += len(calls)
        return "".join(prose), calls

    def flush(self) -> str:
        """At the end of the reply: whatever was held back (an unfinished block stays text)."""
        rest = (TOOL_OPEN if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        return rest


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
