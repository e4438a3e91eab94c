"""A chat reply's text read as its parts: reasoning (--reasoning-parser), then in what follows it prose and tool
calls (--tool-call-parser, or the format the chat template writes), whole or streamed.

    reply text --ReasoningStreamer--> reasoning | content --ToolStreamer--> prose | tool-call chunks

The chat core (OpenAIServing.chat) builds one ReplyFormat per request and reads every choice through it; the
Responses and Messages endpoints get the parts from the chat core's output (chat_bridge.py). Tool calls are
read only after the reasoning: a call the model thinks about is not a call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tokenmill.entrypoints.openai.reasoning import ReasoningParser, get_reasoning_parser
from tokenmill.entrypoints.openai.tool_calls import (
    ToolCall,
    ToolCallChunk,
    ToolParser,
    ToolParserChoice,
    detect_tool_parser,
    get_tool_parser,
    parse_reply,
)

logger = logging.getLogger("tokenmill.server")


class ChatParsers:
    """The server's reply parsers. reasoning_parser: a --reasoning-parser name (None: replies have no reasoning);
    tool_call_parser: a --tool-call-parser name (None: read off the chat template the first time it is needed,
    and logged)."""

    def __init__(self, tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> None:
        if tool_call_parser is not None:
            get_tool_parser(tool_call_parser)  # NOTE: an unknown name fails here, naming the choices
        self.reasoning: ReasoningParser | None = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        self.tool_call_parser = tool_call_parser
        self._tools: ToolParser | None = None

    def tool_parser(self, template: str | None) -> ToolParser:
        """The tool-call parser (chosen once: the chat template does not change while serving)."""
        if self._tools is None:
            if self.tool_call_parser is not None:
                choice = ToolParserChoice(self.tool_call_parser, "--tool-call-parser")
            else:
                choice = detect_tool_parser(template)
            self._tools = get_tool_parser(choice.name)
            logger.info(
                "chat replies: tool calls read as %s (%s); reasoning %s",
                choice.name,
                choice.why,
                f"split by {self.reasoning.name}" if self.reasoning else "not split (no --reasoning-parser)",
            )
        return self._tools


@dataclass(frozen=True)
class ReplyFormat:
    """How the replies to one chat request are read."""

    reasoning: ReasoningParser | None = None
    is_reasoning_open: bool = False
    """The reply starts inside the reasoning (ReasoningParser.is_open_after the rendered prompt)."""
    tools: ToolParser | None = None
    """None when the request offers no tools (or tool_choice is none)."""
    tool_names: frozenset[str] = frozenset()
    is_one_call: bool = False
    """parallel_tool_calls false: only the first call counts."""


@dataclass(frozen=True)
class ReplyParts:
    reasoning: str | None
    """None when the reply has no reasoning (or no reasoning parser is set)."""
    content: str | None
    calls: list[ToolCall]


def reply_parts(fmt: ReplyFormat, text: str) -> ReplyParts:
    """A whole reply as its parts. With calls, the content is the prose around them, stripped (None when empty);
    without, the text after the reasoning as it is (None when there is reasoning and nothing after it)."""
    reasoning, content = None, text
    if fmt.reasoning is not None:
        split = fmt.reasoning.split(text, fmt.is_reasoning_open)
        reasoning, content = split.reasoning, split.content
    if fmt.tools is not None:
        parsed = parse_reply(fmt.tools, content, fmt.tool_names)
        if parsed.calls:
            return ReplyParts(reasoning, parsed.content, parsed.calls[:1] if fmt.is_one_call else parsed.calls)
    return ReplyParts(reasoning, (content or None) if reasoning is not None else content, [])


@dataclass
class ReplyDelta:
    reasoning: str = ""
    content: str = ""
    chunks: list[ToolCallChunk] = field(default_factory=list)


class ReplyStream:
    """One streamed choice: feed each text delta, with is_final on the last (flushing what was held back)."""

    def __init__(self, fmt: ReplyFormat) -> None:
        self.fmt = fmt
        self.reasoning = fmt.reasoning.streamer(fmt.is_reasoning_open) if fmt.reasoning is not None else None
        self.tools = fmt.tools.streamer(fmt.tool_names) if fmt.tools is not None else None
        self.num_calls = 0
        """Calls streamed so far."""

    def feed(self, delta: str, is_final: bool) -> ReplyDelta:
        out = ReplyDelta(content=delta)
        if self.reasoning is not None:
            r = self.reasoning.feed(delta)
            out.reasoning, out.content = r.reasoning, r.content
            if is_final:
                r = self.reasoning.flush()
                out.reasoning += r.reasoning
                out.content += r.content
        if self.tools is not None:
            t = self.tools.feed(out.content)
            if is_final:
                t += self.tools.flush()
            out.content = t.prose
            out.chunks = [c for c in t.chunks if not (self.fmt.is_one_call and c.index > 0)]
            self.num_calls = max([self.num_calls, *(c.index + 1 for c in out.chunks)])
        return out
