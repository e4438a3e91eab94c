"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): a translation onto the chat core.

    MessagesRequest --to chat--> ChatCompletionRequest --OpenAIServing.chat--> ChatRun --> message / events

    system (a string or text blocks)           -> a system message first
    messages: text blocks                       -> the turn's text
              tool_use blocks (assistant)       -> the assistant turn's tool calls
              tool_result blocks (user)         -> tool messages, before the turn's text
              thinking blocks                   -> dropped (the model's own earlier reasoning)
    max_tokens, stop_sequences, temperature, top_p, top_k -> max_completion_tokens, stop, the same
    output_config.format (json_schema)          -> response_format (the grammar engine)
    tools (input_schema), tool_choice (auto | any | tool | none), disable_parallel_tool_use -> the chat tools
    thinking: enabled or adaptive (needs --reasoning-parser for enabled) -> the reply's reasoning as a thinking
                                                 block first; disabled or absent -> no thinking block
    finish "length" -> stop_reason max_tokens; a stop sequence -> stop_sequence (and which); a call -> tool_use;
    else end_turn. usage: input_tokens counts the prompt tokens not read from the prefix cache, and
    cache_read_input_tokens those that were (Anthropic's split), so their sum is count_tokens' answer.

Streaming events (SSE with `event:` lines): message_start, ping, then per content block content_block_start,
content_block_delta (thinking_delta, text_delta, or input_json_delta with a fragment of a tool call's input as
the model writes it), content_block_stop;
then message_delta (stop_reason, stop_sequence, usage) and message_stop. An engine failure: an error event.

Every error on these paths is Anthropic's shape, {"type": "error", "error": {"type", "message"}}: the server
renders its errors through anthropic_error_body for them (is_messages_path).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenmill.entrypoints.openai.chat_bridge import (
    ChatEnd,
    ChatReply,
    ChatUsage,
    ReasoningTextDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallDone,
    ToolCallStart,
    chat_events,
    chat_reply,
    chat_request,
    json_text,
    renamed,
    tool_call_message,
    tool_result_message,
)
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, UnsupportedParameterError
from tokenmill.entrypoints.openai.serving import OpenAIError, OpenAIServing, SSEStream
from tokenmill.entrypoints.openai.tool_calls import ToolCall

MESSAGES_PATH = "/v1/messages"

PARAM_NAMES = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "structured_outputs.json": "output_config.format.schema",
}
"""The chat core's field -> the Messages API's, for errors."""

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_body(err: OpenAIError) -> dict[str, Any]:
    """err as Anthropic's error object (its type follows the HTTP status, as Anthropic's does)."""
    kind = _ERROR_TYPES.get(err.status_code, "invalid_request_error" if err.status_code < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


# --- request ---------------------------------------------------------------------------------------


class AnthropicBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TextBlock(AnthropicBaseModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    """Accepted and ignored: the prefix cache is automatic."""
    citations: list[Any] | None = None


class ToolUseBlock(AnthropicBaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(AnthropicBaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(AnthropicBaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(AnthropicBaseModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


class MessageParam(AnthropicBaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def _check(self) -> MessageParam:
        for b in self.content if isinstance(self.content, list) else []:
            if isinstance(b, ToolUseBlock) and self.role != "assistant":
                raise UnsupportedParameterError("messages.content", "tool_use blocks belong to assistant messages")
            if isinstance(b, ToolResultBlock) and self.role != "user":
                raise UnsupportedParameterError("messages.content", "tool_result blocks belong to user messages")
        return self


class Tool(AnthropicBaseModel):
    type: Literal["custom"] | None = None
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    """A JSON schema of the input object."""
    strict: bool | None = None
    """Accepted: a forced call (tool_choice any or tool) follows input_schema by grammar either way."""
    cache_control: dict[str, Any] | None = None


class ToolChoice(AnthropicBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise UnsupportedParameterError("tool_choice.name", "tool_choice of type tool needs a name (only it)")
        return self


class ThinkingConfig(AnthropicBaseModel):
    type: Literal["enabled", "disabled", "adaptive"]
    """enabled or adaptive: the reply's reasoning comes back as a thinking block (enabled needs a server with
    --reasoning-parser; adaptive is accepted either way: a model that does not reason decides not to)."""
    budget_tokens: int | None = Field(None, ge=0, le=2**31 - 1)
    """Accepted and not enforced: the model's template decides how long it reasons (max_tokens bounds it)."""

    @property
    def is_shown(self) -> bool:
        return self.type != "disabled"


class JsonOutputFormat(AnthropicBaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class OutputConfig(AnthropicBaseModel):
    format: JsonOutputFormat | None = None
    """Structured output: the reply follows the schema (the grammar engine)."""
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    """Accepted and ignored: it sets how much a reasoning model thinks."""


class Metadata(AnthropicBaseModel):
    user_id: str | None = None


class CountTokensRequest(AnthropicBaseModel):
    """POST /v1/messages/count_tokens."""

    model: str
    messages: list[MessageParam] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(..., ge=1, le=2**31 - 1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None
    """Accepted and ignored: the prefix cache is automatic."""


# --- translation -----------------------------------------------------------------------------------


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The request's system and messages as chat messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        out.append({"role": "system", "content": system})
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
        calls = [ToolCall(b.name, json_text(b.input), b.id) for b in m.content if isinstance(b, ToolUseBlock)]
        results = [tool_result_message(b.tool_use_id, b.text()) for b in m.content if isinstance(b, ToolResultBlock)]
        out += results
        if calls:
            out.append(tool_call_message(calls, text))
        elif text or not results:
            out.append({"role": m.role, "content": text})
    return out


def chat_fields(req: CountTokensRequest) -> dict[str, Any]:
    """The ChatCompletionRequest fields of a Messages (or count_tokens) request."""
    fields: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if isinstance(req, MessagesRequest):
        fields.update(
            max_completion_tokens=req.max_tokens,
            stop=req.stop_sequences,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stream=req.stream,
        )
        fmt = req.output_config.format if req.output_config else None
        if fmt is not None:
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt.schema_},
            }
    return fields


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name, "input": json.loads(call.arguments)}


def _stop(reply: ChatReply, stop_sequences: list[str] | None) -> dict[str, Any]:
    """stop_reason and stop_sequence of a finished reply."""
    if reply.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if reply.calls:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(reply.stop_reason, str) and reply.stop_reason in (stop_sequences or []):
        return {"stop_reason": "stop_sequence", "stop_sequence": reply.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(u: ChatUsage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    }


class MessagesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _check_thinking(self, req: CountTokensRequest) -> None:
        if req.thinking is not None and req.thinking.type == "enabled" and self.serving.chat_parsers.reasoning is None:
            raise OpenAIError(
                "extended thinking needs a reasoning model served with --reasoning-parser", param="thinking"
            )

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, Any]:
        """The prompt's tokens, rendered as /v1/messages renders it."""
        self._check_thinking(req)
        chat = chat_request(chat_fields(req), PARAM_NAMES)
        try:
            ids = await self.serving.chat_prompt_ids(chat)
        except OpenAIError as e:
            raise renamed(e, PARAM_NAMES) from e
        return {"input_tokens": len(ids)}

    async def create(self, req: MessagesRequest) -> tuple[dict[str, Any] | None, SSEStream | None]:
        """Returns (message, None) or (None, SSE events). Raises OpenAIError (rendered in Anthropic's shape)."""
        model = self.serving.resolve_model(req.model)
        self._check_thinking(req)
        chat = chat_request(chat_fields(req), PARAM_NAMES)
        try:
            run = await self.serving.chat(chat)
        except OpenAIError as e:
            raise renamed(e, PARAM_NAMES) from e
        message_id = f"msg_{uuid.uuid4().hex}"
        if run.chunks is not None:
            return None, SSEStream(
                self._events(req, chat, model, message_id, run.num_prompt_tokens, run.chunks), run.streams
            )
        assert run.response is not None
        reply = chat_reply(run.response)
        content = [_tool_use_block(c) for c in reply.calls]
        if reply.text or not reply.calls:
            content.insert(0, _text_block(reply.text))
        if reply.reasoning is not None and _shows_thinking(req):
            content.insert(0, _thinking_block(reply.reasoning))
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            **_stop(reply, req.stop_sequences),
            "usage": _usage(reply.usage),
        }, None

    async def _events(
        self,
        req: MessagesRequest,
        chat: ChatCompletionRequest,
        model: str,
        message_id: str,
        num_prompt_tokens: int,
        chunks: AsyncIterator[dict[str, Any]],
    ) -> AsyncIterator[str]:
        start: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(ChatUsage(prompt_tokens=num_prompt_tokens)),
        }
        yield _event("message_start", message=start)
        yield _event("ping")
        blocks = _Blocks()
        shows_thinking = _shows_thinking(req)
        try:
            async for ev in chat_events(chat, chunks):
                if isinstance(ev, ReasoningTextDelta):
                    if shows_thinking:
                        for e in blocks.open("thinking", _thinking_block("")):
                            yield e
                        yield blocks.delta({"type": "thinking_delta", "thinking": ev.text})
                elif isinstance(ev, TextDelta):
                    for e in blocks.open("text", _text_block("")):
                        yield e
                    yield blocks.delta({"type": "text_delta", "text": ev.text})
                elif isinstance(ev, ToolCallStart):
                    block = {**_tool_use_block(ToolCall(ev.name, "{}", ev.id)), "input": {}}
                    for e in blocks.open("tool_use", block, is_new=True):
                        yield e
                elif isinstance(ev, ToolCallArgs):
                    yield blocks.delta({"type": "input_json_delta", "partial_json": ev.text})
                elif isinstance(ev, ToolCallDone):
                    for e in blocks.close():
                        yield e
                else:
                    assert isinstance(ev, ChatEnd)
                    if not blocks.has_text_or_tool:  # an empty reply is one empty text block, as without stream
                        for e in blocks.open("text", _text_block("")):
                            yield e
                    for e in blocks.close():
                        yield e
                    stop = _stop(ev.reply, req.stop_sequences)
                    yield _event("message_delta", delta=stop, usage=_usage(ev.reply.usage))
                    yield _event("message_stop")
        except OpenAIError as e:
            yield _event("error", error=anthropic_error_body(e)["error"])


def _shows_thinking(req: MessagesRequest) -> bool:
    return req.thinking is not None and req.thinking.is_shown


class _Blocks:
    """The content blocks of a streamed message: at most one open, numbered from 0."""

    def __init__(self) -> None:
        self.index = 0
        """The open block's index, or the next one's."""
        self.kind: str | None = None
        self.has_text_or_tool = False

    def open(self, kind: str, block: dict[str, Any], is_new: bool = False) -> list[str]:
        """Events that make a block of `kind` the open one (the one open already, unless is_new)."""
        if self.kind == kind and not is_new:
            return []
        out = self.close()
        self.kind = kind
        self.has_text_or_tool |= kind != "thinking"
        return [*out, _event("content_block_start", index=self.index, content_block=block)]

    def delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", index=self.index, delta=delta)

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        self.index += 1
        return [_event("content_block_stop", index=self.index - 1)]


def _thinking_block(text: str) -> dict[str, Any]:
    """A thinking block; its signature is empty (tokenmill does not sign, and drops thinking blocks sent back)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json_text({'type': kind, **fields})}\n\n"
