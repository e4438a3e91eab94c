"""What the Responses and Anthropic Messages endpoints share: both translate their request into a
ChatCompletionRequest, run it through OpenAIServing.chat (the chat completions core: chat template, tools,
structured outputs, sampling, the engine), and read the result back through the types here.

    API request --(its module)--> ChatCompletionRequest --> OpenAIServing.chat --> ChatRun
    ChatRun.response --chat_reply--> ChatReply                                  --(its module)--> API response
    ChatRun.chunks   --chat_events--> ReasoningTextDelta / TextDelta /
                                      ToolCallStart / ToolCallArgs / ToolCallDone / ChatEnd --(its module)--> SSE

A translated request that the chat core refuses is a 400 naming the calling API's field (`param_names` maps the
chat field to it), so a client never reads a field name of an API it did not call.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, UnsupportedParameterError
from tokenmill.entrypoints.openai.serving import OpenAIError
from tokenmill.entrypoints.openai.text_stream import StrippedStream
from tokenmill.entrypoints.openai.tool_calls import ToolCall


def chat_request(fields: dict[str, Any], param_names: dict[str, str]) -> ChatCompletionRequest:
    """fields as a ChatCompletionRequest; with `stream`, its chunks end with the usage chunk (chat_events needs
    it). A field the chat core refuses is an OpenAIError (400) naming the caller's field."""
    if fields.get("stream"):
        fields = {**fields, "stream_options": {"include_usage": True}}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, UnsupportedParameterError):
            param, message = cause.param, str(cause)
        else:
            param = ".".join(str(x) for x in first.get("loc", ()))
            message = f"Invalid value for '{param}': {first.get('msg', 'invalid')}"
        raise renamed(OpenAIError(message, param=param), param_names) from None


def renamed(err: OpenAIError, param_names: dict[str, str]) -> OpenAIError:
    """err with its param (and the param quoted in its message) in the calling API's names."""
    if err.param is None or err.param not in param_names:
        return err
    new = param_names[err.param]
    message = err.message.replace(f"'{err.param}'", f"'{new}'")
    return OpenAIError(message, status_code=err.status_code, type=err.type, param=new, code=err.code)


@dataclass
class ChatUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose K/V came from the prefix cache (part of prompt_tokens)."""

    @classmethod
    def from_dict(cls, usage: dict[str, Any] | None) -> ChatUsage:
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return cls(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), details.get("cached_tokens", 0))


@dataclass
class ChatReply:
    """One finished chat choice in the terms both APIs translate from."""

    text: str = ""
    """The prose (tool-call blocks removed)."""
    reasoning: str | None = None
    """The reasoning (--reasoning-parser), None when there is none."""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    """The chat core's: "stop", "length", "tool_calls" or "abort"."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it (None at EOS)."""
    usage: ChatUsage = field(default_factory=ChatUsage)


def chat_reply(response: dict[str, Any]) -> ChatReply:
    """The first choice of a chat completion body."""
    choice = response["choices"][0]
    message = choice["message"]
    return ChatReply(
        text=message.get("content") or "",
        reasoning=message.get("reasoning_content"),
        calls=[_tool_call(c) for c in message.get("tool_calls") or []],
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        usage=ChatUsage.from_dict(response.get("usage")),
    )


@dataclass
class ReasoningTextDelta:
    text: str


@dataclass
class TextDelta:
    text: str


@dataclass
class ToolCallStart:
    """A call begins: its id and name (its arguments follow as ToolCallArgs)."""

    id: str
    name: str


@dataclass
class ToolCallArgs:
    """A fragment of the arguments of the call started last."""

    text: str


@dataclass
class ToolCallDone:
    """The call started last is complete (nothing more of it follows)."""

    call: ToolCall


@dataclass
class ChatEnd:
    """The last event: the whole reply (text joined from the deltas), its finish and usage."""

    reply: ChatReply


ChatEvent = ReasoningTextDelta | TextDelta | ToolCallStart | ToolCallArgs | ToolCallDone | ChatEnd


class _OpenCall:
    def __init__(self, index: int, call_id: str, name: str) -> None:
        self.index, self.id, self.name = index, call_id, name
        self.arguments: list[str] = []

    def done(self) -> ToolCallDone:
        return ToolCallDone(ToolCall(self.name, "".join(self.arguments), self.id))


async def chat_events(req: ChatCompletionRequest, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[ChatEvent]:
    """The chunks of streamed `req` (made by chat_request, so they end with usage) as events of its first choice.
    Tool calls arrive as OpenAI streams them (a head with id and name, then argument fragments); a call is done
    when prose, another call or the end follows it. Within one chunk: reasoning, the open call's fragments, prose,
    then new calls (the order they can have in the reply). With tools, the prose is trimmed as the reply without
    stream trims it (parse_reply), so both say the same. An engine failure in the stream raises OpenAIError."""
    reply = ChatReply()
    text: list[str] = []
    reasoning: list[str] = []
    trim = StrippedStream() if req.tools and req.effective_tool_choice != "none" else None
    call: _OpenCall | None = None
    async for chunk in chunks:
        if "error" in chunk:
            e = chunk["error"]
            raise OpenAIError(e["message"], status_code=503, type=e["type"], code=e.get("code"))
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
                yield ReasoningTextDelta(delta["reasoning_content"])
            pieces = delta.get("tool_calls") or []
            k = 0  # NOTE: the open call's fragments come first in a chunk, before any head
            while k < len(pieces) and call is not None and "id" not in pieces[k]:
                if pieces[k]["index"] == call.index and pieces[k]["function"].get("arguments"):
                    call.arguments.append(pieces[k]["function"]["arguments"])
                    yield ToolCallArgs(pieces[k]["function"]["arguments"])
                k += 1
            content = delta.get("content") or ""
            if trim is not None:
                content = trim.feed(content)
            if content:
                if call is not None:
                    reply.calls.append((done := call.done()).call)
                    yield done
                    call = None
                text.append(content)
                yield TextDelta(content)
            for c in pieces[k:]:
                if "id" in c:  # a new call's head
                    if call is not None:
                        reply.calls.append((done := call.done()).call)
                        yield done
                    call = _OpenCall(c["index"], c["id"], c["function"].get("name") or "")
                    yield ToolCallStart(call.id, call.name)
                if call is not None and c["index"] == call.index and c["function"].get("arguments"):
                    call.arguments.append(c["function"]["arguments"])
                    yield ToolCallArgs(c["function"]["arguments"])
            if choice.get("finish_reason") is not None:
                reply.finish_reason = choice["finish_reason"]
                reply.stop_reason = choice.get("stop_reason")
        if chunk.get("usage"):
            reply.usage = ChatUsage.from_dict(chunk["usage"])
    if call is not None:
        reply.calls.append((done := call.done()).call)
        yield done
    reply.text = "".join(text)
    reply.reasoning = "".join(reasoning) if reasoning else None
    yield ChatEnd(reply)


def tool_call_message(calls: list[ToolCall], text: str | None = None) -> dict[str, Any]:
    """An assistant chat message carrying tool calls (a turn the client sends back)."""
    return {"role": "assistant", "content": text or None, "tool_calls": [c.to_dict() for c in calls]}


def tool_result_message(call_id: str, text: str) -> dict[str, Any]:
    """The chat message of a tool's result."""
    return {"role": "tool", "content": text, "tool_call_id": call_id}


def json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tool_call(c: dict[str, Any]) -> ToolCall:
    return ToolCall(c["function"]["name"], c["function"]["arguments"], c["id"])
