"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a reply's reasoning split from its answer.

Both parsers read think tags, as Qwen3 and DeepSeek-R1 write them:

    <think>
    The user wants a city. Paris is the largest.
    </think>

    {"city": "Paris"}

    reasoning: "The user wants a city. Paris is the largest."   (stripped)
    content:   '{"city": "Paris"}'                              (whitespace after the end tag dropped)

The reply starts either inside the reasoning ("open": the output may still repeat the start tag, which is dropped)
or before it ("closed": only a reply that begins with the start tag has reasoning; any other is all content):

    qwen3        open when the rendered prompt ends with <think> (a template that opens the block itself),
                 else closed; a prompt ending in "<think>\\n\\n</think>" (thinking switched off) is closed
    deepseek_r1  always open: DeepSeek-R1 may write its reasoning without the start tag (its template wrote it),
                 so everything up to </think> is reasoning, and a reply without </think> is all reasoning

The streamed parser gives, joined, exactly what the whole-reply parser gives (split() runs it in one piece);
a tag split across deltas is held back until it is whole or cannot be one. A constraint (response_format, a
forced tool call) applies after the reasoning: fence() is the grammar's view of the same tags
(tokenmill/structured/reasoning.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tokenmill.entrypoints.openai.text_stream import StrippedStream, partial_suffix
from tokenmill.structured.reasoning import ReasoningFence


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None
    """None when the reply has no reasoning block."""
    content: str


class ReasoningStreamer(Protocol):
    def feed(self, delta: str) -> ReasoningDelta: ...

    def flush(self) -> ReasoningDelta:
        """At the end of the reply: what was held back."""
        ...


class ReasoningParser(Protocol):
    @property
    def name(self) -> str: ...

    def is_open_after(self, prompt: str) -> bool:
        """Whether a reply to this rendered prompt starts inside its reasoning."""
        ...

    def fence(self, is_open: bool) -> ReasoningFence: ...

    def streamer(self, is_open: bool) -> ReasoningStreamer: ...

    def split(self, text: str, is_open: bool) -> ReasoningSplit: ...


@dataclass(frozen=True)
class ThinkTagParser:
    name: str
    is_always_open: bool = False
    """DeepSeek-R1's rule: the reply starts inside the reasoning whatever the prompt."""
    start: str = "<think>"
    end: str = "</think>"

    def is_open_after(self, prompt: str) -> bool:
        return self.is_always_open or prompt.rstrip().endswith(self.start)

    def fence(self, is_open: bool) -> ReasoningFence:
        return ReasoningFence(self.start, self.end, is_open)

    def streamer(self, is_open: bool) -> ThinkTagStreamer:
        return ThinkTagStreamer(self.start, self.end, is_open)

    def split(self, text: str, is_open: bool) -> ReasoningSplit:
        s = self.streamer(is_open)
        a, b = s.feed(text), s.flush()
        return ReasoningSplit(a.reasoning + b.reasoning if s.has_reasoning else None, a.content + b.content)


class ThinkTagStreamer:
    """The state machine behind ThinkTagParser, fed a reply's text deltas:

    HEAD (only whitespace so far, or a prefix of the start tag) -> REASONING (after the start tag, or at once
    when open) -> AFTER (the end tag seen: whitespace dropped) -> CONTENT; a closed reply whose first text is
    not the start tag goes HEAD -> CONTENT with everything held so far."""

    _HEAD, _REASONING, _AFTER, _CONTENT = range(4)

    def __init__(self, start: str, end: str, is_open: bool) -> None:
        self.start, self.end, self.is_open = start, end, is_open
        self.state = self._HEAD
        self.buf = ""
        self.reasoning = StrippedStream()
        self.has_reasoning = False

    def feed(self, delta: str) -> ReasoningDelta:
        self.buf += delta
        reasoning, content = "", ""
        while True:
            if self.state == self._HEAD:
                head = self.buf.lstrip()
                if head.startswith(self.start):
                    self.buf = head[len(self.start) :]
                    self._enter_reasoning()
                elif not head or self.start.startswith(head):
                    break  # NOTE: whitespace, or the start tag in pieces: wait
                elif self.is_open:
                    self._enter_reasoning()
                else:
                    self.state = self._CONTENT
            elif self.state == self._REASONING:
                i = self.buf.find(self.end)
                if i < 0:
                    keep = partial_suffix(self.buf, self.end)
                    reasoning += self.reasoning.feed(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                reasoning += self.reasoning.feed(self.buf[:i])
                self.buf = self.buf[i + len(self.end) :]
                self.state = self._AFTER
            elif self.state == self._AFTER:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.state = self._CONTENT
            else:
                content += self.buf
                self.buf = ""
                break
        return ReasoningDelta(reasoning, content)

    def flush(self) -> ReasoningDelta:
        rest, self.buf = self.buf, ""
        if self.state == self._REASONING:
            return ReasoningDelta(reasoning=self.reasoning.feed(rest))  # a cut tag is reasoning text
        if self.state == self._HEAD and self.is_open and rest.strip():
            self.has_reasoning = True
            return ReasoningDelta(reasoning=self.reasoning.feed(rest))
        if self.state == self._HEAD and not self.is_open:
            return ReasoningDelta(content=rest)
        return ReasoningDelta()

    def _enter_reasoning(self) -> None:
        self.state = self._REASONING
        self.has_reasoning = True


REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "deepseek_r1": lambda: ThinkTagParser("deepseek_r1", is_always_open=True),
    "qwen3": lambda: ThinkTagParser("qwen3"),
}
"""--reasoning-parser names (vLLM's) -> their parser."""


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}"
        ) from None
