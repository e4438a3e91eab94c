"""Requests -> token ids and SamplingParams; engine outputs -> OpenAI responses and SSE chunks.

Runs on the event loop, tokenizing short texts there and long ones in worker threads (Rust tokenizers,
no torch; INLINE_TOKENIZE_CHARS), and talks to the engine through AsyncEngine. Every way a request can be
wrong becomes an OpenAIError (4xx) before the engine sees it, or from the ValueError the core raises when it
refuses a request.

Bounded work before refusing: a text longer than max_model_len times the longest vocabulary
entry (in characters) cannot fit the context whatever it tokenizes to, so it is refused without
tokenizing it. NOTE: this assumes the tokenizer's normalizer does not shorten text (true of
byte-level BPE and SentencePiece-style tokenizers).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import json
import logging
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import jinja2

from tokenmill.distributed.kv_connector import HoldForDecode, KVTransferRequest, PullFromPrefill
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from tokenmill.entrypoints.openai.chat_output import ChatParsers, ReplyFormat, ReplyStream, reply_parts
from tokenmill.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    ModelCard,
    ModelList,
    NamedToolChoice,
    PromptTokensDetails,
    SamplingFields,
    TokenizeRequest,
    UsageInfo,
)
from tokenmill.errors import InvalidRequest
from tokenmill.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, truncate_embedding
from tokenmill.sampling_params import POOLING_TYPES, SamplingParams, StructuredOutputs
from tokenmill.structured.reasoning import after_reasoning
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

INLINE_TOKENIZE_CHARS = 4096
"""Texts up to this many characters are tokenized on the event loop, longer ones in a worker thread, so a long
prompt cannot stall every stream. Tokenizing costs ~0.22 us per character with the default model's BPE (0.9 ms
at 4,096; a ShareGPT prompt 0.17 ms on average), but the hop to a thread and back does not come cheap while the
engine's threads hold both cores of a 2-core host: under the 32-stream serving load of benchmarks/vs_vllm.py it
took 3.3 ms at the median and 52 ms at p90 (13-87 ms in the burst of 32 requests at the start), all of it in
the request's time to first token (docs/benchmarks.md, "Where served TTFT goes")."""


def utf8_safe(text: str) -> str:
    """text with what UTF-8 cannot encode (lone surrogates a client sent) backslash-escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class OpenAIError(Exception):
    """An error answered with OpenAI's error object.

    message and param may echo what the client sent; they are made UTF-8-safe here, so that
    rendering the error can never fail (a lone surrogate in `model` once turned a 404 into a 500).
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        message = utf8_safe(message)
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = None if param is None else utf8_safe(param)
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def engine_unavailable(e: Exception) -> OpenAIError:
    return OpenAIError(str(e), status_code=503, type="service_unavailable", code="engine_unavailable")


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None
    """The prompt as text (given, or decoded from token ids) for echo."""


@dataclass
class _ChoiceState:
    """Streaming bookkeeping of one choice: what was already sent."""

    num_chars: int = 0
    num_tokens: int = 0
    is_started: bool = False
    is_finished: bool = False


@dataclass
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def info(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )

    def to_dict(self) -> dict[str, Any]:
        return self.info().model_dump()


@dataclass
class SSEStream:
    """An SSE body and the engine requests behind it.

    close() aborts whatever is unfinished; the server calls it after the response in every case,
    since a body iterator cancelled before its first step never runs its own cleanup.
    """

    body: AsyncIterator[str]
    streams: list[RequestStream]

    async def close(self) -> None:
        for s in self.streams:
            s.close()


@dataclass
class ChatRun:
    """One chat request on the engine (OpenAIServing.chat): the chat completion body, or with stream its chunks
    (chat.completion.chunk bodies as dicts; an engine failure ends them with an error body {"error": ...}).
    A streaming caller hands `streams` to its SSEStream, which aborts them once the response is over."""

    request_id: str
    num_prompt_tokens: int
    """The rendered prompt's tokens (known before the first chunk)."""
    streams: list[RequestStream]
    response: dict[str, Any] | None = None
    chunks: AsyncIterator[dict[str, Any]] | None = None


@dataclass
class _TopLogprob:
    """One ranked alternative: its text and JSON-safe log-probability."""

    text: str
    logprob: float | None


@dataclass
class _TokenLogprobs:
    """One sampled token of a choice as both OpenAI logprob formats read it (OpenAIServing._token_logprobs)."""

    text: str
    logprob: float | None
    """JSON-safe (_lp); None where the engine kept no entry for the token."""
    top: list[_TopLogprob]
    """Alternatives best first (by the engine's rank), decoded."""


@dataclass
class _Finals:
    """Final outputs of all prompts of one HTTP request, by prompt index."""

    outputs: dict[int, RequestOutput] = field(default_factory=dict)


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        served_model_names: list[str],
        model_root: str | None = None,
        embedding_pooling: str = "last",
        *,
        chat_template: str | None = None,
        chat_parsers: ChatParsers | None = None,
    ) -> None:
        """embedding_pooling: how /v1/embeddings pools the final hidden states ("last" token or "mean");
        chat_template: in place of the model's (--chat-template); chat_parsers: how chat replies are read
        (--tool-call-parser, --reasoning-parser)."""
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        if embedding_pooling not in POOLING_TYPES:
            raise ValueError(f"embedding pooling must be one of {', '.join(POOLING_TYPES)}, got {embedding_pooling!r}")
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.model_root = model_root
        self.embedding_pooling = embedding_pooling
        self.chat_template = chat_template
        self.chat_parsers = chat_parsers or ChatParsers()
        self._templated: Tokenizer | None = None
        """The engine's tokenizer with chat_template in place of its own."""
        self.num_tokenized_in_thread = 0
        """Texts tokenized in a worker thread (longer than INLINE_TOKENIZE_CHARS); tests read it."""

    # --- shared ------------------------------------------------------------------------------

    def resolve_model(self, name: str | None) -> str:
        if name is None or name == "":
            return self.served_model_names[0]
        if name not in self.served_model_names:
            raise OpenAIError(
                f"The model `{name}` does not exist.", status_code=404, param="model", code="model_not_found"
            )
        return name

    def describe_chat_parsers(self) -> None:
        """Log how chat replies are read (the tool-call format chosen and why, the reasoning parser)."""
        with contextlib.suppress(OpenAIError):  # NOTE: nothing to say before the model has loaded
            self.chat_parsers.tool_parser(self._tokenizer.chat_template)

    def models(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, root=self.model_root, max_model_len=self.engine.max_model_len)
                for name in self.served_model_names
            ]
        )

    @property
    def _tokenizer(self):
        tok = self.engine.tokenizer
        if tok is None:
            raise engine_unavailable(RuntimeError("the model is still loading"))
        if self.chat_template is None:
            return tok
        if self._templated is None or self._templated.hf is not tok.hf:
            self._templated = dataclasses.replace(tok, chat_template=self.chat_template)
        return self._templated

    @functools.cached_property
    def _max_token_chars(self) -> int:
        """Characters the longest token can stand for: its vocabulary entry's length, which is
        its byte count for byte-level BPE (never fewer than the characters it decodes to)."""
        return max(1, max(len(s) for s in self._tokenizer.hf.get_vocab(with_added_tokens=True)))

    async def _encode(self, text: str, add_special_tokens: bool, max_tokens: int | None, what: str) -> list[int]:
        """Token ids of text, refused (400) if it cannot fit the context; see the module docstring."""
        if text:
            self._check_length(-(-len(text) // self._max_token_chars), max_tokens, what, is_lower_bound=True)
        tokenizer = self._tokenizer
        try:
            if len(text) <= INLINE_TOKENIZE_CHARS:
                ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            else:
                self.num_tokenized_in_thread += 1
                ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)
        except Exception as e:  # noqa: BLE001 - e.g. lone surrogates the Rust side cannot encode
            raise OpenAIError(f"the {what} could not be tokenized: {e}", param=what) from e
        return ids

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.vocab_size or self._tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"token id {bad[0]} is out of range [0, {vocab})", param=param)

    def _decode(self, ids: list[int]) -> str:
        self._check_token_ids(ids, "tokens")
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def _render_chat(
        self, messages: list[ChatMessage], add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> str:
        tok = self._tokenizer
        native_tools = tools is not None and tok.template_renders_tools
        msgs = []
        for m in messages:
            role = "system" if m.role == "developer" else m.role
            calls = (m.model_extra or {}).get("tool_calls")
            if native_tools:  # the template has a tool format: give it OpenAI's shapes
                msg: dict[str, Any] = {"role": role, "content": m.text()}
                if calls:
                    msg["tool_calls"] = calls
                if (m.model_extra or {}).get("tool_call_id"):
                    msg["tool_call_id"] = m.model_extra["tool_call_id"]
                msgs.append(msg)
            elif calls:  # in the tool parser's format, as the model was asked to write it (tool_calls.py)
                blocks = self.chat_parsers.tool_parser(tok.chat_template).render_calls(calls)
                msgs.append({"role": role, "content": (m.text() + "\n" if m.text() else "") + blocks})
            elif role == "tool":
                msgs.append({"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"})
            else:
                msgs.append({"role": role, "content": m.text()})
        if tools is not None and not native_tools:
            block = self.chat_parsers.tool_parser(tok.chat_template).system_prompt(tools)
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + block}
            else:
                msgs.insert(0, {"role": "system", "content": block})
        try:
            return tok.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt, tools=tools if native_tools else None
            )
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise OpenAIError(f"messages could not be rendered with the chat template: {e}", param="messages") from e

    def _check_length(self, prompt_len: int, max_tokens: int | None, what: str, is_lower_bound: bool = False) -> None:
        """is_lower_bound: prompt_len is a bound from the text's length (not tokenized yet)."""
        max_len = self.engine.max_model_len or 0
        at_least = "at least " if is_lower_bound else ""
        if prompt_len == 0:
            raise OpenAIError(f"the {what} is empty", param=what)
        if max_tokens is None:
            if prompt_len >= max_len:
                raise OpenAIError(
                    f"This model's maximum context length is {max_len} tokens. However, your {what} has "
                    f"{at_least}{prompt_len} tokens, which leaves no room for the completion.",
                    param=what,
                    code="context_length_exceeded",
                )
        elif prompt_len + max_tokens > max_len:
            raise OpenAIError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{at_least}{prompt_len + max_tokens} tokens ({at_least}{prompt_len} in the {what}, {max_tokens} in "
                f"the completion). Please reduce the length of the {what} or of max_tokens.",
                param=what if prompt_len >= max_len else "max_tokens",
                code="context_length_exceeded",
            )

    def _sampling_params(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        structured: StructuredOutputs | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """structured: a constraint of the server's own (tool calls) in place of the request's; prompt_logprobs: in
        place of the request's (completions with echo)."""
        vocab = self.engine.vocab_size or self._tokenizer.vocab_size
        top_k = req.top_k if req.top_k is not None else 0
        if top_k >= vocab:
            top_k = 0  # NOTE: keeping all tokens is what top_k >= vocab means
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                seed=req.seed,
                stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else req.prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                structured_outputs=structured or req.structured(),
                # streams are built from deltas (O(new) per step); other replies need the final output only
                output_kind="delta" if req.stream else "final",
            )
        except InvalidRequest as e:
            raise OpenAIError(e.message, param=e.param, code=e.code) from e
        except (ValueError, TypeError) as e:
            raise OpenAIError(str(e)) from e

    async def _start(
        self,
        prompts: list[_Prompt],
        params: SamplingParams,
        prefix: str,
        cache_salt: str | None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> list[RequestStream]:
        """Add one engine request per prompt; all or none (a refused one aborts the others)."""
        kv_transfer = _kv_transfer(kv_transfer_params, len(prompts))
        streams: list[RequestStream] = []
        try:
            for p in prompts:
                rid = self.engine.new_request_id(prefix)
                streams.append(
                    await self.engine.add_request(
                        p.token_ids,
                        params,
                        request_id=rid,
                        prompt=p.text,
                        cache_salt=cache_salt,
                        kv_transfer=kv_transfer,
                    )
                )
        except BaseException as e:
            for s in streams:
                s.close()
            if isinstance(e, InvalidRequest):
                raise OpenAIError(e.message, param=e.param, code=e.code) from e
            if isinstance(e, ValueError):
                raise OpenAIError(str(e)) from e
            if isinstance(e, (EngineDeadError, RuntimeError)) and not isinstance(e, asyncio.CancelledError):
                raise engine_unavailable(e) from e
            raise
        return streams

    # --- completions ---------------------------------------------------------------------------

    async def _completion_prompts(self, req: CompletionRequest) -> list[_Prompt]:
        """The prompts as token ids, each checked against the context length before more work on it."""
        return await self._prompts(req.prompt, req.max_tokens, bool(req.echo), "prompt")

    async def _prompts(
        self, given: str | list[str] | list[int] | list[list[int]], max_tokens: int | None, with_text: bool, what: str
    ) -> list[_Prompt]:
        """Text, texts, token ids or token-id lists (completions' prompt, embeddings' input) as token ids, each
        checked against the context length; with_text: token-id prompts decoded too (for echo)."""
        p = [given] if isinstance(given, str) else given
        out = []
        if all(isinstance(x, str) for x in p):
            for text in p:
                assert isinstance(text, str)
                ids = await self._encode(text, True, max_tokens, what)
                self._check_length(len(ids), max_tokens, what)
                out.append(_Prompt(ids, text))
            return out
        for ids in [p] if all(isinstance(x, int) for x in p) else p:
            assert isinstance(ids, list)
            self._check_length(len(ids), max_tokens, what)
            self._check_token_ids(ids, what)
            out.append(
                _Prompt(list(ids), self._tokenizer.decode(ids, skip_special_tokens=False) if with_text else None)
            )
        return out

    async def create_completion(self, req: CompletionRequest) -> tuple[dict[str, Any] | None, SSEStream | None]:
        """Returns (response body, None) or (None, SSE iterator). Raises OpenAIError."""
        model = self.resolve_model(req.model)
        prompts = await self._completion_prompts(req)
        params = self._sampling_params(req, req.max_tokens, req.logprobs, prompt_logprobs=req.effective_prompt_logprobs)
        streams = await self._start(prompts, params, "cmpl", req.cache_salt, req.kv_transfer_params)
        request_id = f"cmpl-{streams[0].request_id.split('-', 1)[1]}"
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return None, SSEStream(
                self._stream_completion(req, model, request_id, created, prompts, streams, include_usage), streams
            )
        finals = await _collect(streams)
        choices, usage = [], _Usage()
        for i, p in enumerate(prompts):
            out = finals.outputs[i]
            usage.prompt_tokens += len(out.prompt_token_ids)
            usage.cached_tokens += out.num_cached_tokens
            for c in out.outputs:
                usage.completion_tokens += len(c.token_ids)
                prefix = p.text if req.echo and p.text is not None else ""
                lps = None
                if req.logprobs is not None:
                    lps = self._completion_logprobs(c, 0, len(c.token_ids), len(prefix))
                    if req.echo:  # the echoed prompt's tokens first (OpenAI: the first one's logprob is null)
                        lps = _joined(self._echo_logprobs(out.prompt_token_ids, out.prompt_logprobs), lps)
                choices.append(
                    CompletionChoice(
                        index=i * req.n + c.index,
                        text=prefix + c.text,
                        logprobs=lps,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=self._prompt_logprobs(out.prompt_logprobs)
                        if req.prompt_logprobs is not None
                        else None,
                    )
                )
        choices.sort(key=lambda ch: ch.index)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage.info(),
            kv_transfer_params=finals.outputs[0].kv_transfer_params,
        ).model_dump(), None

    def _token_text(self, token_id: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_logprobs(self, c: CompletionOutput, start: int, end: int, top_n: int | None) -> list[_TokenLogprobs]:
        """Tokens [start, end) of a choice with their log-probabilities, in the engine's terms, for both OpenAI
        formats. A token missing from its position's entry has logprob None (and no alternatives where the engine
        kept no entry there at all); top_n: how many ranked alternatives to decode (None: all the entry holds)."""
        out = []
        all_lps = c.logprobs or []
        for j in range(start, min(end, len(c.token_ids))):
            tid = c.token_ids[j]
            entry = all_lps[j] if j < len(all_lps) else {}
            sampled = entry.get(tid)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            top = [
                _TopLogprob(self._token_text(t, lp), _lp(lp.logprob))
                for t, lp in (ranked if top_n is None else ranked[:top_n])
            ]
            logprob = _lp(sampled.logprob) if sampled is not None else None
            out.append(_TokenLogprobs(self._token_text(tid, sampled), logprob, top))
        return out

    def _completion_logprobs(self, c: CompletionOutput, start: int, end: int, offset: int) -> dict[str, Any]:
        """OpenAI's legacy logprobs object for tokens [start, end) of a choice; offset: text before them."""
        tokens, token_logprobs, top, text_offset = [], [], [], []
        for t in self._token_logprobs(c, start, end, None):
            tokens.append(t.text)
            token_logprobs.append(t.logprob)
            top.append({alt.text: alt.logprob for alt in t.top})
            text_offset.append(offset)
            offset += len(t.text)
        return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}

    def _echo_logprobs(self, ids: list[int], entries: PromptLogprobs | None) -> dict[str, Any]:
        """OpenAI's legacy logprobs object for an echoed prompt: each token with its log-probability given the tokens
        before it and its alternatives (null for the first token, which has no context), text offsets from 0."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float | None] | None] = []
        text_offset: list[int] = []
        offset = 0
        for j, tid in enumerate(ids):
            entry = entries[j] if entries is not None and j < len(entries) else None
            own = entry.get(tid) if entry is not None else None
            text = self._token_text(tid, own)
            tokens.append(text)
            text_offset.append(offset)
            offset += len(text)
            token_logprobs.append(_lp(own.logprob) if own is not None else None)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank) if entry is not None else None
            top.append(None if ranked is None else {self._token_text(t, lp): _lp(lp.logprob) for t, lp in ranked})
        return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}

    def _prompt_logprobs(self, entries: PromptLogprobs | None) -> list[dict[int, dict[str, Any]] | None] | None:
        """vLLM's prompt_logprobs field: per prompt position {token id: {logprob, rank, decoded_token}}, None first."""
        if entries is None:
            return None
        return [
            None
            if d is None
            else {
                t: {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": self._token_text(t, lp)}
                for t, lp in d.items()
            }
            for d in entries
        ]

    def _stream_completion(
        self,
        req: CompletionRequest,
        model: str,
        request_id: str,
        created: int,
        prompts: list[_Prompt],
        streams: list[RequestStream],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        n = req.n
        echo = [p.text or "" for p in prompts for _ in range(n)] if req.echo else None
        # echo with logprobs: the prompt's text and logprobs go out in each choice's first chunk, once computed
        fold = echo is not None and req.logprobs is not None
        head = (
            [
                {"index": idx, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
                for idx, text in enumerate(echo)
            ]
            if echo and not fold
            else []
        )
        prompt_lps: dict[int, PromptLogprobs] = {}
        """Prompt index -> its prompt logprobs (the first output of its stream carries them)."""
        started: set[int] = set()

        def observe(i: int, out: RequestOutput) -> None:
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs

        def choice(idx: int, c: CompletionOutput, st: _ChoiceState) -> dict[str, Any]:
            offset = st.num_chars + (len(echo[idx]) if echo else 0)
            lps = self._completion_logprobs(c, 0, len(c.token_ids), offset) if req.logprobs is not None else None
            body = {
                "index": idx,
                "text": c.text,
                "logprobs": lps,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if idx not in started:
                started.add(idx)
                i = idx // n
                if fold and echo is not None and lps is not None:
                    body["text"] = echo[idx] + c.text
                    body["logprobs"] = _joined(self._echo_logprobs(prompts[i].token_ids, prompt_lps.get(i)), lps)
                if req.prompt_logprobs is not None:
                    body["prompt_logprobs"] = self._prompt_logprobs(prompt_lps.get(i))
            return body

        return _sse_body(
            self._chunks(
                streams, n, "text_completion", request_id, created, model, include_usage, head, choice, observe
            )
        )

    # --- chat ----------------------------------------------------------------------------------

    async def create_chat_completion(
        self, req: ChatCompletionRequest
    ) -> tuple[dict[str, Any] | None, SSEStream | None]:
        run = await self.chat(req)
        if run.chunks is None:
            return run.response, None
        return None, SSEStream(_sse_body(run.chunks), run.streams)

    async def chat(self, req: ChatCompletionRequest) -> ChatRun:
        """The chat core every chat-shaped API runs through: chat completions here, and the Responses and
        Anthropic Messages endpoints, which translate their requests into a ChatCompletionRequest and the
        ChatRun back (chat template, tools, structured outputs and sampling are decided here only).
        Raises OpenAIError."""
        model = self.resolve_model(req.model)
        tools = _chat_tools(req)
        prompt = await self._chat_prompt(req)
        ids, text = prompt.token_ids, prompt.text
        max_tokens = req.effective_max_tokens
        self._check_length(len(ids), max_tokens, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        fmt = self._reply_format(req, tools, text or "")
        params = self._sampling_params(req, max_tokens, logprobs, self._chat_constraint(req, tools, fmt))
        streams = await self._start([_Prompt(ids, text)], params, "chatcmpl", req.cache_salt, req.kv_transfer_params)
        request_id = f"chatcmpl-{streams[0].request_id.split('-', 1)[1]}"
        created = int(time.time())
        top_n = req.top_logprobs or 0
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = self._stream_chat(req, model, request_id, created, streams[0], include_usage, top_n, fmt)
            return ChatRun(request_id, len(ids), streams, chunks=chunks)
        out = (await _collect(streams)).outputs[0]
        choices = []
        for c in out.outputs:
            parts = reply_parts(fmt, c.text)
            message = ChatResponseMessage(
                content=parts.content,
                reasoning_content=parts.reasoning,
                tool_calls=[k.to_dict() for k in parts.calls] or None,
            )
            reason = "tool_calls" if parts.calls and c.finish_reason == "stop" else c.finish_reason
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=ChatLogprobs(content=self._chat_logprobs(c, 0, len(c.token_ids), top_n))
                    if req.logprobs
                    else None,
                    finish_reason=reason,
                    stop_reason=c.stop_reason,
                )
            )
        usage = _Usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)
        response = ChatCompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage.info(),
            prompt_logprobs=self._prompt_logprobs(out.prompt_logprobs) if req.prompt_logprobs is not None else None,
            kv_transfer_params=out.kv_transfer_params,
        ).model_dump()
        return ChatRun(request_id, len(ids), streams, response=response)

    def _reply_format(self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None, prompt: str) -> ReplyFormat:
        """How this request's replies are read (chat_output.py); prompt: the rendered prompt."""
        reasoning = self.chat_parsers.reasoning
        return ReplyFormat(
            reasoning=reasoning,
            is_reasoning_open=reasoning is not None and reasoning.is_open_after(prompt),
            tools=self.chat_parsers.tool_parser(self._tokenizer.chat_template) if tools is not None else None,
            tool_names=frozenset(t["function"]["name"] for t in tools or []),
            is_one_call=req.parallel_tool_calls is False,
        )

    def _chat_constraint(
        self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None, fmt: ReplyFormat
    ) -> StructuredOutputs | None:
        """The grammar a chat reply follows: forced tool calls (tool_choice "required" or a named function) in the
        tool parser's format, or the request's own constraint; with a reasoning parser, only after the reasoning."""
        choice = req.effective_tool_choice
        constraint = req.structured()
        if tools is not None and choice != "auto" and fmt.tools is not None:
            named = choice.function.name if isinstance(choice, NamedToolChoice) else None
            funcs = [t["function"] for t in tools if named is None or t["function"]["name"] == named]
            parallel = req.parallel_tool_calls is not False and choice == "required"
            constraint = StructuredOutputs(grammar=fmt.tools.grammar(funcs, parallel))
        if constraint is None or fmt.reasoning is None:
            return constraint
        try:
            return after_reasoning(constraint, fmt.reasoning.fence(fmt.is_reasoning_open))
        except InvalidRequest as e:
            raise OpenAIError(e.message, param=e.param, code=e.code) from e

    async def chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        """The token ids of the prompt chat(req) would run (messages and tools through the chat template)."""
        self.resolve_model(req.model)
        return (await self._chat_prompt(req)).token_ids

    async def _chat_prompt(self, req: ChatCompletionRequest) -> _Prompt:
        text = self._render_chat(req.messages, req.add_generation_prompt, _chat_tools(req))
        return _Prompt(await self._encode(text, False, req.effective_max_tokens, "messages"), text)

    def _chat_logprobs(self, c: CompletionOutput, start: int, end: int, top_n: int) -> list[dict[str, Any]]:
        """The chat format's `content` list for tokens [start, end) of a choice: a token without an entry gets
        the clamped floor (the format has no null logprob), and at most top_n alternatives each."""
        return [
            {
                "token": t.text,
                "logprob": t.logprob if t.logprob is not None else _MIN_LOGPROB,
                "bytes": list(t.text.encode("utf-8", "replace")),
                "top_logprobs": [
                    {"token": alt.text, "logprob": alt.logprob, "bytes": list(alt.text.encode("utf-8", "replace"))}
                    for alt in t.top
                ],
            }
            for t in self._token_logprobs(c, start, end, top_n)
        ]

    def _stream_chat(
        self,
        req: ChatCompletionRequest,
        model: str,
        request_id: str,
        created: int,
        stream: RequestStream,
        include_usage: bool,
        top_n: int,
        fmt: ReplyFormat,
    ) -> AsyncIterator[dict[str, Any]]:
        head = [
            {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for k in range(req.n)
        ]
        replies = [ReplyStream(fmt) for _ in range(req.n)]

        def choice(idx: int, c: CompletionOutput, st: _ChoiceState) -> dict[str, Any]:
            lps = {"content": self._chat_logprobs(c, 0, len(c.token_ids), top_n)} if req.logprobs else None
            r = replies[idx].feed(c.text, c.finish_reason is not None)
            delta: dict[str, Any] = {}
            if r.reasoning:
                delta["reasoning_content"] = r.reasoning
            if r.content:
                delta["content"] = r.content
            if r.chunks:  # OpenAI's shape: a call's head (id, name, arguments ""), then argument fragments
                delta["tool_calls"] = [k.to_dict() for k in r.chunks]
            reason = "tool_calls" if c.finish_reason == "stop" and replies[idx].num_calls else c.finish_reason
            out = {"index": idx, "delta": delta, "logprobs": lps, "finish_reason": reason}
            if c.finish_reason is not None:
                out["stop_reason"] = c.stop_reason
            return out

        return self._chunks(
            [stream], req.n, "chat.completion.chunk", request_id, created, model, include_usage, head, choice
        )

    async def _chunks(
        self,
        streams: list[RequestStream],
        n: int,
        obj: str,
        request_id: str,
        created: int,
        model: str,
        include_usage: bool,
        head: list[dict[str, Any]],
        choice: Callable[[int, CompletionOutput, _ChoiceState], dict[str, Any]],
        observe: Callable[[int, RequestOutput], None] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """The chunks of both streaming endpoints, as dicts (_sse_body writes them as SSE). The engine sends
        deltas (output_kind "delta"; a lagging reader gets them joined), so each chunk is built from what is new
        only: `head` first (echo, the role), then per engine output one choice per sample with news (`choice`
        formats it; `observe` sees each engine output first, with its prompt index), then usage; an engine failure
        ends them with an error body."""
        chunk = _chunk_writer(request_id, obj, created, model, include_usage)
        states = [_ChoiceState() for _ in range(len(streams) * n)]
        usage = _Usage()
        try:
            if head:
                yield chunk(head)
            async for i, out in _merge(streams):
                if observe is not None:
                    observe(i, out)
                choices = []
                for c in out.outputs:
                    idx = i * n + c.index
                    st = states[idx]
                    if st.is_finished or (not c.text and not c.token_ids and c.finish_reason is None):
                        continue
                    choices.append(choice(idx, c, st))
                    st.num_chars += len(c.text)
                    st.num_tokens += len(c.token_ids)
                    st.is_finished = c.finish_reason is not None
                if out.finished:
                    usage.prompt_tokens += len(out.prompt_token_ids)
                    usage.cached_tokens += out.num_cached_tokens
                if choices:
                    yield chunk(choices)
            if include_usage:
                usage.completion_tokens = sum(st.num_tokens for st in states)
                yield {
                    "id": request_id,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage.to_dict(),
                }
        except EngineDeadError as e:
            yield engine_unavailable(e).to_dict()
        finally:
            for s in streams:
                s.close()

    # --- embeddings ----------------------------------------------------------------------------

    async def create_embedding(self, req: EmbeddingRequest) -> tuple[dict[str, Any], None]:
        """POST /v1/embeddings: one prompt-only engine request per input, pooled (embedding_pooling) and
        L2-normalised in the runner; dimensions keeps the first values, normalised again. Raises OpenAIError."""
        model = self.resolve_model(req.model)
        size = self.engine.hidden_size or 0
        if req.dimensions is not None and req.dimensions > size:
            raise OpenAIError(
                f"dimensions ({req.dimensions}) exceeds the model's embedding size ({size})", param="dimensions"
            )
        prompts = await self._prompts(req.input, 0, False, "input")
        params = SamplingParams(max_tokens=0, pooling=self.embedding_pooling, output_kind="final")
        streams = await self._start(prompts, params, "embd", None)
        finals = await _collect(streams)
        data, num_tokens = [], 0
        for i in range(len(prompts)):
            out = finals.outputs[i]
            assert out.embedding is not None, "a pooling request finishes with its embedding"
            vec = out.embedding if req.dimensions is None else truncate_embedding(out.embedding, req.dimensions)
            data.append(EmbeddingData(index=i, embedding=_encoded(vec, req.encoding_format)))
            num_tokens += len(out.prompt_token_ids)
        usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        return EmbeddingResponse(data=data, model=model, usage=usage).model_dump(), None

    # --- tokenizer endpoints -------------------------------------------------------------------

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """Token ids of any text that could fit the context; a longer one is a 400 (bounded work)."""
        ids = await self._tokenize_request(req)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    async def _tokenize_request(self, req: TokenizeRequest) -> list[int]:
        """The token ids of a prompt or messages, encoded as the completion or chat endpoint encodes them."""
        self.resolve_model(req.model)
        if req.messages is not None:
            return await self._encode(
                self._render_chat(req.messages, req.add_generation_prompt), False, None, "messages"
            )
        return await self._encode(req.prompt or "", req.add_special_tokens, None, "prompt")

    async def kv_plan(self, req: TokenizeRequest) -> dict[str, Any]:
        """num_prompt_tokens and num_cached_tokens (this worker's prefix-cache hit) for a prompt or messages, encoded
        as the completion or chat endpoint would encode them."""
        ids = await self._tokenize_request(req)
        cached = await self.engine.run_on_engine(lambda core: core.num_cached_prompt_tokens(ids))
        return {"num_prompt_tokens": len(ids), "num_cached_tokens": cached}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.resolve_model(req.model)
        return {"prompt": self._decode(req.tokens)}


_MIN_LOGPROB = -9999.0  # NOTE: JSON has no -inf; vLLM clamps the same way


def _chat_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools a chat request offers the model (none with tool_choice "none")."""
    if not req.tools or req.effective_tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def _kv_transfer(params: dict[str, Any] | None, num_prompts: int) -> KVTransferRequest | None:
    """The request's `kv_transfer_params` (vLLM's spelling) as the engine's KVTransferRequest; 400 when malformed."""
    if params is None:
        return None
    if num_prompts != 1:
        raise OpenAIError(
            "kv_transfer_params: a disaggregated request has exactly one prompt", param="kv_transfer_params"
        )
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise OpenAIError(
            "kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other", param="kv_transfer_params"
        )
    if params.get("do_remote_decode"):
        return HoldForDecode()
    if params.get("do_remote_prefill"):
        try:
            return PullFromPrefill.from_params(params)
        except ValueError as e:
            raise OpenAIError(str(e), param="kv_transfer_params") from None
    raise OpenAIError(
        "kv_transfer_params needs do_remote_decode or do_remote_prefill set to true", param="kv_transfer_params"
    )


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two legacy logprobs objects (the echoed prompt's, the completion's) as one: each list concatenated."""
    return {k: first[k] + then[k] for k in ("text_offset", "token_logprobs", "tokens", "top_logprobs")}


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: the values, or ("base64") their float32 little-endian bytes in base64."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")
    return embedding


def _lp(x: float | None) -> float | None:
    """A JSON-safe log-probability: -inf (a token masked out by top-p/top-k) and NaN become -9999."""
    if x is None:
        return None
    return x if x >= _MIN_LOGPROB else _MIN_LOGPROB  # NOTE: NaN fails the comparison too


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, allow_nan=False)}\n\n"


async def _sse_body(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """OpenAI's SSE body: one event per chunk, then [DONE]."""
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for body in chunks:
            yield _sse(body)
    yield "data: [DONE]\n\n"


def _chunk_writer(request_id: str, obj: str, created: int, model: str, include_usage: bool):
    """choices -> one chunk; with include_usage every chunk but the last carries usage: null."""

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
        if include_usage:
            body["usage"] = None
        return body

    return chunk


async def _collect(streams: list[RequestStream]) -> _Finals:
    """Wait for every stream's final output; closes (aborts) all of them on the way out."""
    finals = _Finals()
    try:
        async for i, out in _merge(streams):
            if out.finished:
                finals.outputs[i] = out
    except EngineDeadError as e:
        raise engine_unavailable(e) from e
    finally:
        for s in streams:
            s.close()
    return finals


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams as (index, output), in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
