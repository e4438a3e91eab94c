"""Pydantic models of the OpenAI API as tokenmill serves it (plus vLLM's extra sampling fields).

Requests are strict: an unknown field is a 400 naming it, and an OpenAI field that tokenmill
does not implement is a 400 saying so (see UNSUPPORTED_*), never silently ignored. Ranges are
OpenAI's where it documents them; the engine-dependent checks (prompt length, token ids below
the vocabulary size) happen in serving.py.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenmill.errors import InvalidRequest
from tokenmill.sampling_params import StructuredOutputs

# Seeds go to torch.Generator.manual_seed, which accepts [-2**63, 2**64).
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# Ids and counts beyond this are nonsense for any model; bounding them keeps torch from overflowing.
_MAX_INT = 2**31 - 1

NonNegInt = Annotated[int, Field(ge=0, le=_MAX_INT)]
TokenId = Annotated[int, Field(ge=0, le=_MAX_INT, strict=True)]
"""A token id: a JSON integer (not true/false, not "12")."""


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=False)


class UnsupportedParameterError(ValueError):
    """Raised inside validators; the server turns it into a 400 whose `param` is .param."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(why)
        self.param = param


def _check_unsupported(data: Any, table: dict[str, tuple[Any, str]]) -> Any:
    """Reject fields set to anything but their harmless value; drop them otherwise."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, (allowed, why) in table.items():
        if name in out:
            value = out.pop(name)
            ok = allowed(value) if callable(allowed) else value in (None, allowed)
            if not ok:
                raise UnsupportedParameterError(name, why)
    return out


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _empty(v: Any) -> bool:
    return v is None or v == {} or v == []


_COMMON_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "logit_bias": (_empty, "logit_bias is not supported by tokenmill"),
    "store": (lambda v: v in (None, False), "store is not supported by tokenmill"),
    "metadata": (_empty, "metadata is not supported by tokenmill (it needs store)"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "service_tier is not supported by tokenmill"),
}

UNSUPPORTED_COMPLETION: dict[str, tuple[Any, str]] = {
    **_COMMON_UNSUPPORTED,
    "suffix": (lambda v: v in (None, ""), "suffix (insertion) is not supported by tokenmill"),
}

UNSUPPORTED_CHAT: dict[str, tuple[Any, str]] = {
    **_COMMON_UNSUPPORTED,
    "functions": (_empty, "functions (function calling) are not supported by tokenmill"),
    "function_call": (lambda v: v in (None, "none"), "function_call is not supported by tokenmill"),
    "audio": (lambda v: v is None, "audio output is not supported by tokenmill"),
    "modalities": (lambda v: v is None or v == ["text"], "modalities other than ['text'] are not supported"),
    "prediction": (lambda v: v is None, "prediction (predicted outputs) is not supported by tokenmill"),
    "reasoning_effort": (lambda v: v is None, "reasoning_effort is not supported by tokenmill"),
    "web_search_options": (lambda v: v is None, "web_search_options is not supported by tokenmill"),
}


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    """Send one more chunk before [DONE] with the usage of the whole request (choices empty)."""
    continuous_usage_stats: bool | None = False
    """vLLM extra; tokenmill does not implement it (400 when true)."""


class JsonSchemaFormat(OpenAIBaseModel):
    """OpenAI's response_format.json_schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(OpenAIBaseModel):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat (OpenAI's and vLLM's extras)."""

    model: str | None = Field(None, description="Served model name; defaults to the first one.")
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=_MAX_INT, description="0 or -1 disables.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="vLLM's extra: the log-probability of every prompt token plus the top-N alternatives at each "
        "position (the first token's entry is null); such a prompt is computed whole, without the prefix cache.",
    )
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(
        None,
        description="Prefix-cache blocks are shared only between requests with the same salt; "
        "give each tenant its own (random, unguessable) salt so one cannot probe another's prompts.",
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = Field(
        None,
        description="vLLM's extra: constrain the output to a JSON schema (json), any JSON object (json_object), "
        "a regex, one of a list of strings (choice) or a Lark/GBNF grammar.",
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older name of structured_outputs.json")
    guided_regex: str | None = Field(None, description="vLLM's older name of structured_outputs.regex")
    guided_choice: list[str] | None = Field(None, description="vLLM's older name of structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="vLLM's older name of structured_outputs.grammar")
    kv_transfer_params: dict[str, Any] | None = Field(
        None,
        description='Disaggregation (vLLM\'s field): {"do_remote_decode": true} on a prefill worker holds the '
        'prompt\'s K/V and returns where they wait; {"do_remote_prefill": true, ...those params} on a decode worker '
        "pulls them. The router (`tokenmill router`) sets both.",
    )

    @model_validator(mode="after")
    def _check_salt(self) -> SamplingFields:
        if self.cache_salt == "":  # NOTE: vLLM's behaviour and message: an error, not "no salt"
            raise UnsupportedParameterError(
                "cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided."
            )
        if self.cache_salt is not None and not _is_utf8(self.cache_salt):
            # NOTE: the engine hashes the salt's UTF-8 bytes; a lone surrogate would fail in the engine thread
            raise UnsupportedParameterError("cache_salt", "cache_salt must be valid Unicode (no lone surrogates)")
        return self

    def structured(self) -> StructuredOutputs | None:
        """The one output constraint the request sets, from whichever field carries it (400 if several do)."""
        found: list[tuple[str, StructuredOutputs]] = []

        def add(param: str, **kw: Any) -> None:
            try:
                found.append((param, StructuredOutputs(**kw)))
            except InvalidRequest as e:
                raise UnsupportedParameterError(param, e.message) from None

        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            add("response_format", json_object=True)
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise UnsupportedParameterError(
                    "response_format.json_schema", "response_format of type json_schema needs json_schema.schema"
                )
            add("response_format", json=rf.json_schema.schema_)
        so = self.structured_outputs
        if so is not None:
            add(
                "structured_outputs",
                json=so.json_,
                json_object=bool(so.json_object),
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
            )
        for name, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            if getattr(self, name) is not None:
                add(name, **{key: getattr(self, name)})
        if len(found) > 1:
            raise UnsupportedParameterError(
                found[1][0], f"give one output constraint; got {', '.join(p for p, _ in found)}"
            )
        return found[0][1] if found else None

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingFields:
        self.structured()
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise UnsupportedParameterError("stream_options", "stream_options is only allowed when stream is true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise UnsupportedParameterError(
                "stream_options.continuous_usage_stats", "continuous_usage_stats is not supported by tokenmill"
            )
        return self


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        ..., description="A string, a list of strings, a list of token ids, or a list of token-id lists."
    )
    max_tokens: int | None = Field(
        16, ge=0, le=_MAX_INT, description="0 generates nothing: with echo and logprobs, the prompt's logprobs only."
    )
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, le=128)

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        return _check_unsupported(data, UNSUPPORTED_COMPLETION)

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedParameterError("best_of", "best_of different from n is not supported by tokenmill")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise UnsupportedParameterError("prompt", "prompt must not be empty")
        return self

    @property
    def effective_prompt_logprobs(self) -> int | None:
        """Prompt logprobs the engine computes: vLLM's prompt_logprobs, or with echo OpenAI's logprobs N (the echoed
        prompt's tokens come with theirs), whichever asks for more alternatives."""
        asked = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(asked) if asked else None


class ChatMessage(BaseModel):
    # NOTE: extra fields allowed: clients echo back assistant messages with `refusal`,
    # `annotations`, etc.; tool calls are rejected below.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    """A string, or content parts of which tokenmill supports {"type": "text", "text": ...}."""
    name: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        extra = self.model_extra or {}
        for key in ("function_call", "audio"):
            if extra.get(key):
                raise UnsupportedParameterError(f"messages.{key}", f"{key} in messages are not supported by tokenmill")
        calls = extra.get("tool_calls")
        if calls:
            if (
                self.role != "assistant"
                or not isinstance(calls, list)
                or not all(
                    isinstance(c, dict)
                    and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str)
                    for c in calls
                )
            ):
                raise UnsupportedParameterError(
                    "messages.tool_calls",
                    "tool_calls belong to assistant messages: "
                    "a list of {id, type: function, function: {name, arguments}}",
                )
        if self.content is None and self.role != "assistant":
            raise UnsupportedParameterError("messages.content", f"a {self.role} message needs content")
        if isinstance(self.content, list):
            for part in self.content:
                kind = part.get("type")
                if kind != "text":
                    raise UnsupportedParameterError(
                        "messages.content", f"content parts of type {kind!r} are not supported (only 'text')"
                    )
                if not isinstance(part.get("text"), str):
                    raise UnsupportedParameterError("messages.content", "a text content part needs a string 'text'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object."""
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: "auto" when tools are given, else "none" (OpenAI's rule)."""
    parallel_tool_calls: bool | None = None
    """Several calls in one reply (default true)."""
    max_tokens: int | None = Field(
        None, ge=1, le=_MAX_INT, description="Deprecated by OpenAI; max_completion_tokens wins when both are set."
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=_MAX_INT)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM extras
    add_generation_prompt: bool = True

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        return _check_unsupported(data, UNSUPPORTED_CHAT)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.prompt_logprobs is not None and self.stream:
            raise UnsupportedParameterError(
                "prompt_logprobs", "prompt_logprobs are returned by non-streaming chat completions only"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedParameterError("top_logprobs", "top_logprobs needs logprobs set to true")
        choice = self.tool_choice
        if choice not in (None, "none", "auto"):
            if not self.tools:
                raise UnsupportedParameterError("tool_choice", "tool_choice other than none/auto needs tools")
            if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                t.function.name for t in self.tools
            }:
                raise UnsupportedParameterError(
                    "tool_choice", f"tool_choice names {choice.function.name!r}, which is not among the tools"
                )
            if self.structured() is not None:
                raise UnsupportedParameterError(
                    "tool_choice",
                    "tool_choice required or a named function already "
                    "constrains the output: drop response_format / structured_outputs",
                )
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class EmbeddingRequest(OpenAIBaseModel):
    """POST /v1/embeddings."""

    model: str | None = Field(None, description="Served model name; defaults to the first one.")
    input: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        ..., description="A string, a list of strings, a list of token ids, or a list of token-id lists."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: a list of numbers; base64: the float32 values, little-endian, base64-encoded."
    )
    dimensions: int | None = Field(
        None, ge=1, le=_MAX_INT, description="Keep the first N values, L2-normalised again (at most the hidden size)."
    )
    user: str | None = None

    @model_validator(mode="after")
    def _check(self) -> EmbeddingRequest:
        if isinstance(self.input, list) and (len(self.input) == 0 or any(x == [] for x in self.input)):
            raise UnsupportedParameterError("input", "input must not be empty")
        return self


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: either prompt or messages (vLLM)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise UnsupportedParameterError("prompt", "give exactly one of prompt and messages")
        if self.messages is not None and len(self.messages) == 0:
            raise UnsupportedParameterError("messages", "messages must not be empty")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


# --- responses ---------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of vLLM's prompt_logprobs (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    """vLLM's extra (prompt_logprobs asked): per prompt position, None for the first."""


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """A prefill worker's answer: where the prompt's K/V wait for a decode worker."""


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    """vLLM's field: the reply's reasoning (--reasoning-parser), null without."""
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    """vLLM's extra (prompt_logprobs asked): per position of the rendered prompt, None for the first."""
    kv_transfer_params: dict[str, Any] | None = None
    """A prefill worker's answer: where the prompt's K/V wait for a decode worker."""


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    """The values, or with encoding_format base64 their float32 bytes (little-endian) in base64."""


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
