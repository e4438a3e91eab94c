"""hermes: calls as JSON between tags, as Hermes and Qwen2.5/3 write them, anywhere in the reply's prose:

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Also the format tokenmill teaches a model whose chat template has no tool format (the default model's ChatML),
through the system prompt. The forcing grammar is Lark with llguidance's `%json` (each call's object
constrained by its function's parameter schema), so a forced call always parses.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.entrypoints.openai.text_stream import partial_suffix
from tokenmill.entrypoints.openai.tool_calls import CutCalls, ToolDeltas, call_arguments
from tokenmill.entrypoints.openai.tool_parsers.json_calls import JsonCallStream

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
ARGS_KEYS = ("arguments", "parameters")


def call_schema(function: dict[str, Any], args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call object of `function`: {"name": its name, args_key: its parameters}."""
    params = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def calls_schema(functions: list[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    """A call object of any of `functions`, compact (as the parsers and clients expect)."""
    if len(functions) == 1:
        schema = call_schema(functions[0], args_key)
    else:
        schema = {"anyOf": [call_schema(f, args_key) for f in functions]}
    schema["x-guidance"] = {"whitespace_flexible": False}
    return schema


def max_calls(functions: list[dict[str, Any]], parallel: bool) -> int:
    """How many calls a forced reply may hold. NOTE: at most one per function offered: a small model told "one
    or more" repeats its call forever."""
    return len(functions) if parallel else 1


class HermesToolParser:
    name = "hermes"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{sigs}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            f"within {TOOL_OPEN}{TOOL_CLOSE} XML tags:\n{TOOL_OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            f"{TOOL_CLOSE}"
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(
            f"{TOOL_OPEN}\n"
            + json.dumps(
                {"name": c["function"]["name"], "arguments": call_arguments(c["function"].get("arguments"))},
                ensure_ascii=False,
            )
            + f"\n{TOOL_CLOSE}"
            for c in calls
        )

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        n = max_calls(functions, parallel)
        repeat = f"{{1,{n}}}" if n > 1 else ""
        schema = json.dumps(calls_schema(functions))
        return f'start: call{repeat}\ncall: "{TOOL_OPEN}\\n" body "\\n{TOOL_CLOSE}\\n"\nbody: %json {schema}\n'

    def streamer(self, tool_names: frozenset[str]) -> HermesStreamer:
        return HermesStreamer()


class HermesStreamer:
    """Prose streams as it comes (text that may be the start of <tool_call> held back); inside a block the call
    object streams through JsonCallStream. A block whose body is not a call stays prose, tags and all; the newline
    that ends a call's block belongs to it."""

    def __init__(self) -> None:
        self.buf = ""
        self.call: JsonCallStream | None = None
        self.in_block = False
        self.is_after_call = False
        """Newlines right after a call's block belong to it (dropped, however the deltas fall)."""
        self.num_calls = 0

    def feed(self, delta: str) -> ToolDeltas:
        self.buf += delta
        out = ToolDeltas()
        while True:
            if not self.in_block:
                if self.is_after_call:
                    self.buf = self.buf.lstrip("\n")
                    self.is_after_call = not self.buf
                start = self.buf.find(TOOL_OPEN)
                if start < 0:
                    keep = partial_suffix(self.buf, TOOL_OPEN)
                    out.prose += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                out.prose += self.buf[:start]
                self.buf = self.buf[start + len(TOOL_OPEN) :]
                self.in_block, self.call = True, None
                continue
            if not self._block(out):
                return out

    def _block(self, out: ToolDeltas) -> bool:
        """Advance inside a block; True when it closed (the loop goes on after it)."""
        body = self.buf.lstrip()
        lead = len(self.buf) - len(body)
        if self.call is None and body.startswith("{"):
            self.call = JsonCallStream(self.num_calls, ARGS_KEYS, None)
        if self.call is not None and not self.call.is_bad:
            out += self.call.feed(body)
            if self.call.is_streaming or self.call.is_done:  # a call (streaming, or whole and parsed)
                if self.call.end is None:
                    return False
                close = self.buf.find(TOOL_CLOSE, lead + self.call.end)
                if close < 0:
                    return False
                self.buf = self.buf[close + len(TOOL_CLOSE) :]
                self.in_block, self.is_after_call = False, True
                self.num_calls += 1
                return True
        if not body:
            return False
        close = self.buf.find(TOOL_CLOSE)
        if close < 0:
            return False
        out.prose += TOOL_OPEN + self.buf[: close + len(TOOL_CLOSE)]  # not a call: the text as written
        self.buf = self.buf[close + len(TOOL_CLOSE) :]
        self.in_block = False
        return True

    def flush(self) -> ToolDeltas:
        rest, self.buf = self.buf, ""
        if not self.in_block:
            return ToolDeltas(prose=rest)
        if self.call is not None and self.call.is_streaming:
            return ToolDeltas(cut=CutCalls(self.num_calls, TOOL_OPEN + rest))
        return ToolDeltas(prose=TOOL_OPEN + rest)
