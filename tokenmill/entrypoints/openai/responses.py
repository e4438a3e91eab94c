"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}: a translation onto the chat core.

    ResponsesRequest --to_chat--> ChatCompletionRequest --OpenAIServing.chat--> ChatRun --> response object / events

    input (a string, or message / function_call / function_call_output items) -> chat messages
    instructions -> a system message first (not carried over by previous_response_id, as OpenAI does)
    max_output_tokens, temperature, top_p -> max_completion_tokens, temperature, top_p
    text.format (text | json_object | json_schema) -> response_format (the grammar engine)
    tools (function), tool_choice, parallel_tool_calls -> the chat tools (tool_calls.py parses the calls)
    reasoning (effort, summary)  -> accepted; with --reasoning-parser the reply's reasoning is a reasoning item
    input reasoning items        -> dropped (the model's earlier reasoning, as chat templates drop it)
    previous_response_id -> the stored conversation of that response, then this input

Stored responses (store: true, the default) live in ResponseStore, an LRU bounded by `--responses-store-size`:
each keeps its response object and its conversation as chat messages (without instructions), so a chained
request renders exactly what the chat endpoint would for the whole history. Errors are OpenAI's error object.

Streaming events, each with a sequence_number from 0, in this order:

    response.created, response.in_progress
    per output item (reasoning, a message with text, or a function_call), in the order the model wrote them:
      reasoning:     response.output_item.added, response.content_part.added (reasoning_text),
                     response.reasoning_text.delta..., response.reasoning_text.done, response.content_part.done,
                     response.output_item.done
      message:       response.output_item.added, response.content_part.added, response.output_text.delta...,
                     response.output_text.done, response.content_part.done, response.output_item.done
      function_call: response.output_item.added, response.function_call_arguments.delta... (fragments as the
                     model writes them), response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it short)
    an engine failure: error, then response.failed
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from tokenmill.entrypoints.openai.chat_bridge import (
    ChatEnd,
    ChatReply,
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
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    FunctionDefinition,
    OpenAIBaseModel,
    UnsupportedParameterError,
)
from tokenmill.entrypoints.openai.serving import OpenAIError, OpenAIServing, SSEStream, utf8_safe
from tokenmill.entrypoints.openai.tool_calls import ToolCall

_MAX_INT = 2**31 - 1

PARAM_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema": "text.format.schema",
    "structured_outputs.json": "text.format.schema",
}
"""The chat core's field -> the Responses API's, for errors."""

UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((None, False), "background responses are not supported by tokenmill"),
    "conversation": ((None,), "conversation is not supported by tokenmill (use previous_response_id)"),
    "prompt": ((None,), "prompt templates are not supported by tokenmill"),
    "max_tool_calls": ((None,), "max_tool_calls is not supported by tokenmill"),
    "top_logprobs": ((None, 0), "top_logprobs is not supported by tokenmill's Responses API"),
    "truncation": ((None, "disabled"), "truncation other than 'disabled' is not supported by tokenmill"),
    "service_tier": ((None, "auto", "default"), "service_tier is not supported by tokenmill"),
}
"""Fields of OpenAI's API that tokenmill accepts only with these values (a 400 naming them otherwise)."""


# --- request ---------------------------------------------------------------------------------------


class TextPart(OpenAIBaseModel):
    """A text content part; output_text parts are what a client echoes back from an earlier response."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    """The arguments object as JSON text."""
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningInputItem(OpenAIBaseModel):
    """A reasoning item a client sends back from an earlier response: accepted and dropped."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] | None = None
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class ReasoningConfig(OpenAIBaseModel):
    """Accepted: whether and how much a model reasons is its chat template's choice here."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


def _item_kind(v: Any) -> str | None:
    """An input item's type; a message may leave it out ({"role", "content"})."""
    if isinstance(v, dict):
        return v.get("type", "message")
    return getattr(v, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(FunctionDefinition):
    """A function tool: the chat API's function definition, flat (no `function` wrapper)."""

    type: Literal["function"]


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise UnsupportedParameterError("text.format.schema", "text.format of type json_schema needs a schema")
        return self


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses."""

    model: str | None = Field(None, description="Served model name; defaults to the first one.")
    input: str | list[InputItem] = Field(
        ..., description="A string (one user message) or a list of message, function_call, function_call_output items."
    )
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=_MAX_INT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = Field(None, description="Accepted; tokenmill has nothing extra to include.")
    # accepted only with their harmless values (UNSUPPORTED)
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    reasoning: ReasoningConfig | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        for name, (allowed, why) in UNSUPPORTED.items():
            if getattr(self, name) not in allowed:
                raise UnsupportedParameterError(name, why)
        if isinstance(self.input, list) and not self.input:
            raise UnsupportedParameterError("input", "input must not be empty")
        if isinstance(self.input, str) and not self.input:
            raise UnsupportedParameterError("input", "input must not be empty")
        fmt = self.text.format if self.text else None
        echoed = {  # NOTE: the response object repeats these; a lone surrogate could not be sent back
            "user": self.user,
            "metadata": "".join(k + v for k, v in (self.metadata or {}).items()),
            "text.format.name": fmt.name if fmt else None,
            "text.format.description": fmt.description if fmt else None,
        }
        for param, value in echoed.items():
            if value is not None and utf8_safe(value) != value:
                raise UnsupportedParameterError(param, f"{param} must be valid Unicode (no lone surrogates)")
        return self


# --- the store -------------------------------------------------------------------------------------


@dataclass
class StoredResponse:
    body: dict[str, Any]
    """The response object, as GET answers it."""
    messages: list[dict[str, Any]]
    """The conversation up to and including this response's output, as chat messages (no instructions)."""


class ResponseStore:
    """Stored responses by id, least recently used evicted beyond max_size (0 stores nothing)."""

    def __init__(self, max_size: int) -> None:
        if max_size < 0:
            raise ValueError(f"the response store size must be >= 0, got {max_size}")
        self.max_size = max_size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, item: StoredResponse) -> None:
        if self.max_size == 0:
            return
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


# --- serving ---------------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _not_found(response_id: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(
        f"Response with id '{response_id}' not found.",
        status_code=404,
        param=param,
        code=code or "response_not_found",
    )


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as chat messages: consecutive function calls join one assistant turn."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(item.name, item.arguments, item.call_id)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call.to_dict())
            elif last is not None and last["role"] == "assistant":
                out[-1] = tool_call_message([call], last["content"])
            else:
                out.append(tool_call_message([call]))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(tool_result_message(item.call_id, item.text()))
    return out


def _reply_messages(reply: ChatReply) -> list[dict[str, Any]]:
    """A reply as the chat message(s) a later turn sees."""
    if reply.calls:
        return [tool_call_message(reply.calls, reply.text)]
    return [{"role": "assistant", "content": reply.text}]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text)] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_reasoning_part(text)] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status != "in_progress" else "",
        "status": status,
    }


def _usage(reply: ChatReply) -> dict[str, Any]:
    u = reply.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


@dataclass
class _Call:
    """What one request needs beyond its chat request: for the response object and the store."""

    req: ResponsesRequest
    model: str
    response_id: str
    created_at: int
    history: list[dict[str, Any]]
    """The conversation before the model's reply (no instructions)."""

    def body(self, status: str, output: list[dict[str, Any]], reply: ChatReply | None) -> dict[str, Any]:
        req = self.req
        is_incomplete = status == "incomplete"
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if is_incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {
                "effort": req.reasoning.effort if req.reasoning else None,
                "summary": req.reasoning.summary if req.reasoning else None,
            },
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": _dump(req.text.format) if req.text and req.text.format else {"type": "text"}},
            "tool_choice": _dump(req.tool_choice) if req.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": _usage(reply) if reply is not None else None,
            "user": req.user,
            "metadata": req.metadata or {},
        }


def _dump(value: Any) -> Any:
    return value.model_dump(by_alias=True, exclude_none=True) if isinstance(value, BaseModel) else value


def _status(reply: ChatReply) -> str:
    return "incomplete" if reply.finish_reason == "length" else "completed"


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    def get(self, response_id: str) -> dict[str, Any]:
        item = self.store.get(response_id)
        if item is None:
            raise _not_found(response_id)
        return item.body

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def create(self, req: ResponsesRequest) -> tuple[dict[str, Any] | None, SSEStream | None]:
        """Returns (response object, None) or (None, SSE events). Raises OpenAIError."""
        model = self.serving.resolve_model(req.model)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise _not_found(req.previous_response_id, "previous_response_id", "previous_response_not_found")
            history = list(prev.messages)
        history += input_messages(req)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat = chat_request(self._chat_fields(req, system + history), PARAM_NAMES)
        try:
            run = await self.serving.chat(chat)
        except OpenAIError as e:
            raise renamed(e, PARAM_NAMES) from e
        call = _Call(req, model, _new_id("resp"), int(time.time()), history)
        if run.chunks is not None:
            return None, SSEStream(self._events(call, chat, run.chunks), run.streams)
        assert run.response is not None
        reply = chat_reply(run.response)
        output = self._output(reply)
        return self._finish(call, reply, output), None

    @staticmethod
    def _chat_fields(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "model": req.model,
            "messages": messages,
            "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stream": bool(req.stream),
            "parallel_tool_calls": req.parallel_tool_calls,
        }
        if req.tools:
            fields["tools"] = [
                {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in req.tools
            ]
        if isinstance(req.tool_choice, FunctionToolChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
        elif req.tool_choice is not None:
            fields["tool_choice"] = req.tool_choice
        fmt = req.text.format if req.text else None
        if fmt is not None and fmt.type == "json_schema":
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict},
            }
        elif fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        return fields

    def _output(self, reply: ChatReply) -> list[dict[str, Any]]:
        output = []
        if reply.reasoning is not None:  # NOTE: complete once anything follows it, as a stream closes it
            status = "completed" if reply.text or reply.calls else _status(reply)
            output.append(_reasoning_item(_new_id("rs"), reply.reasoning, status))
        if reply.text or not reply.calls:
            output.append(_message_item(_new_id("msg"), reply.text, _status(reply)))
        output += [_call_item(_new_id("fc"), c, "completed") for c in reply.calls]
        return output

    def _finish(self, call: _Call, reply: ChatReply, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The final response object; stored unless store is false."""
        body = call.body(_status(reply), output, reply)
        if call.req.store is not False:
            self.store.put(call.response_id, StoredResponse(body, call.history + _reply_messages(reply)))
        return body

    async def _events(
        self, call: _Call, chat: ChatCompletionRequest, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[str]:
        events = _EventWriter()
        yield events.write("response.created", response=call.body("in_progress", [], None))
        yield events.write("response.in_progress", response=call.body("in_progress", [], None))
        output: list[dict[str, Any]] = []
        reasoning = _OpenText(events, output, is_reasoning=True)
        message = _OpenText(events, output, is_reasoning=False)
        function = _OpenCall(events, output)
        try:
            async for ev in chat_events(chat, chunks):
                if isinstance(ev, ReasoningTextDelta):
                    out = reasoning.delta(ev.text)
                elif isinstance(ev, TextDelta):
                    out = reasoning.close("completed") + message.delta(ev.text)
                elif isinstance(ev, ToolCallStart):
                    out = reasoning.close("completed") + message.close("completed") + function.start(ev.id, ev.name)
                elif isinstance(ev, ToolCallArgs):
                    out = function.delta(ev.text)
                elif isinstance(ev, ToolCallDone):
                    out = function.done(ev.call)
                else:
                    assert isinstance(ev, ChatEnd)
                    status = _status(ev.reply)
                    out = reasoning.close(status)
                    if not message.is_used and not function.is_used:  # one message always, as without stream
                        out += message.delta("")
                    out += message.close(status)
                    body = self._finish(call, ev.reply, output)
                    out.append(events.write(f"response.{body['status']}", response=body))
                for e in out:
                    yield e
        except OpenAIError as e:
            yield events.write("error", code=e.code, message=e.message, param=e.param)
            failed = call.body("failed", output, None)
            failed["error"] = {"code": "server_error", "message": e.message}
            yield events.write("response.failed", response=failed)


class _OpenText:
    """The streamed message (or reasoning) item being written: its events, from the first delta to close()."""

    def __init__(self, events: _EventWriter, output: list[dict[str, Any]], is_reasoning: bool) -> None:
        self.events = events
        self.output = output
        self.is_reasoning = is_reasoning
        self.kind = "reasoning_text" if is_reasoning else "output_text"
        self.text: list[str] | None = None
        """The text so far; None while no item is open."""
        self.is_used = False

    def _item(self, item_id: str, text: str, status: str) -> dict[str, Any]:
        return (_reasoning_item if self.is_reasoning else _message_item)(item_id, text, status)

    def _part(self, text: str) -> dict[str, Any]:
        return _reasoning_part(text) if self.is_reasoning else _text_part(text)

    def _extra(self) -> dict[str, Any]:
        return {} if self.is_reasoning else {"logprobs": []}

    def delta(self, text: str) -> list[str]:
        out = []
        if self.text is None:
            item = self._item(_new_id("rs" if self.is_reasoning else "msg"), "", "in_progress")
            self.output.append(item)
            self.text, self.is_used = [], True
            out += [
                self.events.write("response.output_item.added", output_index=len(self.output) - 1, item=item),
                self.events.write("response.content_part.added", **self._where(), part=self._part("")),
            ]
        if text:
            self.text.append(text)
            out.append(self.events.write(f"response.{self.kind}.delta", **self._where(), delta=text, **self._extra()))
        return out

    def close(self, status: str) -> list[str]:
        if self.text is None:
            return []
        where, whole = self._where(), "".join(self.text)
        self.output[-1] = self._item(where["item_id"], whole, status)
        self.text = None
        return [
            self.events.write(f"response.{self.kind}.done", **where, text=whole, **self._extra()),
            self.events.write("response.content_part.done", **where, part=self.output[-1]["content"][0]),
            self.events.write("response.output_item.done", output_index=where["output_index"], item=self.output[-1]),
        ]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1, "content_index": 0}


class _OpenCall:
    """The streamed function_call item being written: added at its head, argument deltas, done at its end."""

    def __init__(self, events: _EventWriter, output: list[dict[str, Any]]) -> None:
        self.events = events
        self.output = output
        self.where: dict[str, Any] | None = None
        self.is_used = False

    def start(self, call_id: str, name: str) -> list[str]:
        item = _call_item(_new_id("fc"), ToolCall(name, "", call_id), "in_progress")
        self.output.append(item)
        self.where, self.is_used = {"item_id": item["id"], "output_index": len(self.output) - 1}, True
        return [self.events.write("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def delta(self, text: str) -> list[str]:
        assert self.where is not None, "arguments come after their call's head"
        return [self.events.write("response.function_call_arguments.delta", **self.where, delta=text)]

    def done(self, call: ToolCall) -> list[str]:
        assert self.where is not None, "a call ends after its head"
        where, self.where = self.where, None
        self.output[where["output_index"]] = item = _call_item(where["item_id"], call, "completed")
        return [
            self.events.write(
                "response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments
            ),
            self.events.write("response.output_item.done", output_index=where["output_index"], item=item),
        ]


class _EventWriter:
    """SSE events of one stream, numbered from 0."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def write(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json_text(body)}\n\n"
