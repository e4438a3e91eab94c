"""Tool calls: what a parsed call is, the ToolParser protocol, and the registry of formats
(`--tool-call-parser`, vLLM's names; the modules are in tool_parsers/ and imported on first use):

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Hermes, Qwen2.5/3)
    llama3_json  [<|python_tag|>]{"name": "f", "parameters": {...}}[; {...}]    (Llama 3.1-3.3)
    pythonic     [f(a=1, b="x"), g()]                                            (Llama 3.2 / 4, parsed with ast)

Without the flag the format is read off the chat template (detect_tool_parser); a template without a tool
format of its own (the default model's ChatML) gets hermes, with the tools in the system prompt.

Each parser owns its format end to end: the system-prompt block and the rendering of earlier calls for a
template that has no format, the grammar that forces calls (tool_choice "required" or a named function), and
the parsing of replies, whole or streamed. A streamed call goes out as OpenAI streams them: one chunk with its
index, id, type and name and empty arguments, then the arguments in fragments as the model writes them. The
whole-reply parse is the streamer run over the reply in one piece, so both give the same calls. A call that
does not parse stays in the content (never an error); once a call's fragments have gone out, text that breaks
it later cannot be taken back (the stream ends that call where it broke).
"""

from __future__ import annotations

import importlib
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol


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
class ToolCallChunk:
    """One streamed piece of call `index`: its head (id and name, arguments "") or a fragment of its arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None
    """Set on the head only."""

    def to_dict(self) -> dict[str, Any]:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class CutCalls:
    """The reply ended inside calls already streamed: calls from `index` on never finished, and `text` is what
    the model wrote of them. A stream cannot take them back; a whole reply keeps that text as content."""

    index: int
    text: str


@dataclass
class ToolDeltas:
    """What one piece of a reply gave: prose to stream now, and call chunks (flush: and the calls cut short)."""

    prose: str = ""
    chunks: list[ToolCallChunk] = field(default_factory=list)
    cut: CutCalls | None = None

    def __iadd__(self, other: ToolDeltas) -> ToolDeltas:
        self.prose += other.prose
        self.chunks += other.chunks
        self.cut = other.cut or self.cut
        return self


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    """The text outside the calls, stripped (None when there is none)."""
    calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_arguments(value: Any) -> Any:
    """A call's arguments sent back by a client, as the model wrote them: OpenAI sends JSON text, some clients an
    object; text that is not JSON stays text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value if value is not None else {}


def assemble_calls(chunks: Iterable[ToolCallChunk]) -> list[ToolCall]:
    """Streamed chunks joined into whole calls, by index."""
    heads: dict[int, ToolCallChunk] = {}
    args: dict[int, list[str]] = {}
    for c in chunks:
        if c.name is not None:
            heads[c.index] = c
        args.setdefault(c.index, []).append(c.arguments)
    return [ToolCall(heads[i].name or "", "".join(args[i]), heads[i].id or new_call_id()) for i in sorted(heads)]


class ToolStreamer(Protocol):
    def feed(self, delta: str) -> ToolDeltas: ...

    def flush(self) -> ToolDeltas:
        """At the end of the reply: what was held back (an unfinished call that never went out is prose; one
        that did is `cut`)."""
        ...


class ToolParser(Protocol):
    @property
    def name(self) -> str: ...

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """The system-prompt block that tells a model whose template has no tool format how to call."""
        ...

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """An assistant turn's calls (OpenAI's shape, arguments as text or object) as the model writes them."""
        ...

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        """Lark (llguidance) for forced calls of `functions` in this format: one call, or with `parallel` up to one
        per function, each call's arguments constrained by its parameter schema."""
        ...

    def streamer(self, tool_names: frozenset[str]) -> ToolStreamer:
        """A parser for one reply; tool_names: the functions offered (untagged formats read only those)."""
        ...


def parse_reply(parser: ToolParser, text: str, tool_names: frozenset[str]) -> ParsedReply:
    """A whole reply split into its prose and its calls: the streamer run in one piece (calls cut short by the
    end of the reply are content)."""
    s = parser.streamer(tool_names)
    out = s.feed(text)
    out += s.flush()
    chunks, prose = out.chunks, out.prose
    if out.cut is not None:
        chunks = [c for c in chunks if c.index < out.cut.index]
        prose += out.cut.text
    return ParsedReply(prose.strip() or None, assemble_calls(chunks))


TOOL_PARSERS = {
    "hermes": "tokenmill.entrypoints.openai.tool_parsers.hermes:HermesToolParser",
    "llama3_json": "tokenmill.entrypoints.openai.tool_parsers.llama3_json:Llama3JsonToolParser",
    "pythonic": "tokenmill.entrypoints.openai.tool_parsers.pythonic:PythonicToolParser",
}
"""--tool-call-parser names (vLLM's) -> module:class, imported on first use."""


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    module, cls = TOOL_PARSERS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


class ToolParserChoice(NamedTuple):
    name: str
    why: str


_TEMPLATE_MARKERS = (
    ("pythonic", "func_name1(", "the template asks for calls as [func_name1(params_name1=...)]"),
    ("hermes", "<tool_call>", "the template writes <tool_call> tags"),
    ("llama3_json", "<|python_tag|>", "the template writes <|python_tag|>"),
    ("llama3_json", '"parameters"', 'the template asks for {"name": ..., "parameters": ...} JSON'),
)
"""Text a chat template's tool format contains -> the parser that reads it; the first match wins."""


def detect_tool_parser(template: str | None) -> ToolParserChoice:
    """The tool-call format a chat template's own tool format is written in (hermes when it has none or when
    none of the markers is in it)."""
    if not template or "tools" not in template:
        return ToolParserChoice("hermes", "the chat template has no tool format: tools go in the system prompt")
    for name, marker, why in _TEMPLATE_MARKERS:
        if marker in template:
            return ToolParserChoice(name, why)
    return ToolParserChoice("hermes", "the chat template reads tools but names no known call format")
