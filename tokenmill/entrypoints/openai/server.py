"""The OpenAI-compatible HTTP server: FastAPI app, error format, auth, metrics, uvicorn runner.

    uvicorn (event loop, main thread)              engine thread (all torch)
    gate: 401 without the key, 503 while loading
    routes -> OpenAIServing -> AsyncEngine  ---->  EngineCore.step() loop

Endpoints: POST /v1/completions, /v1/chat/completions, /v1/embeddings, /tokenize, /detokenize; POST /v1/responses with
GET/DELETE /v1/responses/{id} (responses.py), POST /v1/messages and /v1/messages/count_tokens (Anthropic's
API, anthropic_messages.py; errors on these paths in Anthropic's shape); GET /v1/models,
/v1/models/{id}, /health, /metrics, /version, /debug/kv_cache (free blocks and the KV pool's
integrity check, for tests and operators), /kv/plan (prompt length and local prefix hit, for the router),
/dashboard and /dashboard/stream (the live page and its SSE feed: see dashboard.py).

Shutdown (SIGTERM or SIGINT): uvicorn stops accepting connections and lets in-flight requests
finish for up to `shutdown_timeout` seconds, then cancels them (which aborts them in the
engine); the lifespan hook then stops the engine thread and the process exits 0.

Read timeouts: a request's headers must arrive within `header_timeout_s` of the connection
opening (or of the previous response ending), its body within `body_timeout_s` of its headers;
otherwise the server closes the connection (uvicorn itself only times out idle keep-alives).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

import tokenmill
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError, EngineNotReadyError
from tokenmill.entrypoints.openai.anthropic_messages import (
    CountTokensRequest,
    MessagesRequest,
    MessagesServing,
    anthropic_error_body,
    is_messages_path,
)
from tokenmill.entrypoints.openai.chat_output import ChatParsers
from tokenmill.entrypoints.openai.dashboard import COOKIE_NAME, DashboardFeed, dashboard_cookie, page_html
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnsupportedParameterError,
)
from tokenmill.entrypoints.openai.responses import ResponsesRequest, ResponsesServing, ResponseStore
from tokenmill.entrypoints.openai.serving import OpenAIError, OpenAIServing, SSEStream, engine_unavailable
from tokenmill.metrics import EngineMetrics, StatLogger

logger = logging.getLogger("tokenmill.server")

_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/debug/", "/kv/")
_NEEDS_ENGINE_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/debug/", "/health", "/kv/")
_DASHBOARD_PREFIX = "/dashboard"

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    503: {"model": ErrorResponse, "description": "The model is still loading"},
}
_SSE_RESPONSE = {200: {"content": {"text/event-stream": {}}, "description": "JSON body, or SSE chunks when stream"}}


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: list[str]
    model_root: str | None = None
    api_key: str | None = None
    log_stats_interval_s: float | None = 10.0
    """None disables the periodic stats log line."""
    dashboard_interval_s: float = 0.5
    """Seconds between two updates of the dashboard's live feed (only while a page is open)."""
    responses_store_size: int = 1024
    """Responses kept for previous_response_id and GET /v1/responses/{id}, least recently used evicted; 0 keeps
    none."""
    embedding_pooling: str = "last"
    """How /v1/embeddings pools the prompt's final hidden states: "last" token or "mean"."""
    chat_template: str | None = None
    """A Jinja chat template in place of the model's (--chat-template)."""
    tool_call_parser: str | None = None
    """The tool-call format (--tool-call-parser); None: read off the chat template."""
    reasoning_parser: str | None = None
    """How reasoning is split from replies (--reasoning-parser); None: it is not."""


def _error_response(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None, path: str = ""
) -> JSONResponse:
    return _error_json(OpenAIError(message, status_code=status, type=type, param=param, code=code), path)


def _error_json(err: OpenAIError, path: str) -> JSONResponse:
    """err in the shape of the API that `path` belongs to: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    body = anthropic_error_body(err) if is_messages_path(path) else err.to_dict()
    return JSONResponse(body, status_code=err.status_code)


class GateMiddleware:
    """Pure ASGI (streams stay cancellable): 401 without the API key, 503 until the model loaded."""

    def __init__(self, app: ASGIApp, engine: AsyncEngine, api_key: str | None) -> None:
        self.app = app
        self.engine = engine
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        if self.api_key is not None and path.startswith(_DASHBOARD_PREFIX):
            resp = self._dashboard_gate(scope, path)
            if resp is not None:
                await resp(scope, receive, send)
                return
        elif self.api_key is not None and path.startswith(_PROTECTED_PREFIXES):
            if not self._has_key(scope):
                resp = _error_response(
                    401,
                    "Incorrect or missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                    "invalid_request_error",
                    code="invalid_api_key",
                    path=path,
                )
                await resp(scope, receive, send)
                return
        if path.startswith(_NEEDS_ENGINE_PREFIXES) and not self.engine.is_ready:
            status = self.engine.status
            if status.is_dead:
                msg = f"the engine failed and cannot serve requests: {status.error}"
            else:
                msg = "the model is still loading; retry shortly"
            resp = _error_response(
                503,
                msg,
                "service_unavailable",
                code="model_loading" if not status.is_dead else "engine_dead",
                path=path,
            )
            resp.headers["Retry-After"] = "5"
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _has_key(self, scope: Scope) -> bool:
        """The key as 'Authorization: Bearer <key>' or as 'x-api-key: <key>' (Anthropic's header)."""
        assert self.api_key is not None
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return True
        x_api_key = headers.get(b"x-api-key")
        return x_api_key is not None and hmac.compare_digest(x_api_key.strip(), self.api_key.encode())

    def _dashboard_gate(self, scope: Scope, path: str) -> Response | None:
        """None lets the request through: a Bearer header or the dashboard cookie. `?api_key=<key>` on the
        page trades the key for the cookie (303 back to the bare page, so the key leaves the address bar)."""
        assert self.api_key is not None
        if self._has_key(scope):
            return None
        expected = dashboard_cookie(self.api_key)
        cookies = SimpleCookie()
        with contextlib.suppress(Exception):
            cookies.load(dict(scope.get("headers") or []).get(b"cookie", b"").decode("latin-1"))
        morsel = cookies.get(COOKIE_NAME)
        if morsel is not None and hmac.compare_digest(morsel.value.encode(), expected.encode()):
            return None
        offered = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key", [""])[0]
        if offered and hmac.compare_digest(offered.encode(), self.api_key.encode()):
            resp = RedirectResponse(path, status_code=303)
            resp.set_cookie(COOKIE_NAME, expected, httponly=True, samesite="strict", path=_DASHBOARD_PREFIX)
            return resp
        return _error_response(
            401,
            "Incorrect or missing API key: open /dashboard?api_key=<key> once (it sets a "
            "cookie), or send 'Authorization: Bearer <key>'.",
            "invalid_request_error",
            code="invalid_api_key",
        )


_UNION_HINTS = {
    "prompt": "expected a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "expected a string or a list of strings",
    "messages": "expected a list of messages {role, content}; content is a string or a list of text parts",
    "input": "expected a string or a list of items of type message, function_call or function_call_output",
}
_EMBEDDINGS_PATH = "/v1/embeddings"
_EMBEDDINGS_INPUT_HINT = "expected a string, a list of strings, a list of token ids, or a list of token-id lists"


def _validation_error(exc: RequestValidationError, path: str = "") -> JSONResponse:
    """A 400 naming the field, in the shape of the API that `path` belongs to."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    ctx_err = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_err, UnsupportedParameterError):
        return _error_response(
            400,
            str(ctx_err),
            "invalid_request_error",
            param=ctx_err.param,
            code="unsupported_parameter" if "not supported" in str(ctx_err) else None,
            path=path,
        )
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return _error_response(
            400,
            f"The request body is not valid JSON: {detail}",
            "invalid_request_error",
            code="invalid_json",
            path=path,
        )
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # NOTE: union members show up as loc entries like "str" or "list[str]"; keep the field path only.
    loc = [x for x in loc if not any(ch in x for ch in "[]") and x not in ("str", "int", "float", "bool")]
    param = ".".join(loc) or None
    kind = first.get("type")
    if kind == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param}"
        return _error_response(400, msg, "invalid_request_error", param=param, code="unknown_parameter", path=path)
    if kind == "missing":
        return _error_response(
            400,
            f"Missing required parameter: '{param}'.",
            "invalid_request_error",
            param=param,
            code="missing_required_parameter",
            path=path,
        )
    msg = first.get("msg", "invalid request")
    field = loc[0] if loc else None
    same_field = [e for e in errors if [str(x) for x in e.get("loc", ()) if x != "body"][:1] == loc[:1]]
    if field in _UNION_HINTS and len(same_field) > 1:
        msg = _UNION_HINTS[field]  # NOTE: one pydantic error per union member says little; say what fits
        if field == "input" and path == _EMBEDDINGS_PATH:
            msg = _EMBEDDINGS_INPUT_HINT
        errors = [e for e in errors if e not in same_field] + [first]
    if param:
        msg = f"Invalid value for '{param}': {msg}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return _error_response(400, msg, "invalid_request_error", param=param, code="invalid_value", path=path)


async def _cancel_on_disconnect(request: Request, work: Callable[[], Any]) -> Any:
    """Run work(); if the client disconnects first, cancel it (the request is aborted in the engine)."""
    task = asyncio.ensure_future(work())

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return Response(status_code=499)  # NOTE: nobody reads it; the client is gone


def build_app(
    engine: AsyncEngine, settings: ServerSettings, metrics: EngineMetrics | None = None, *, manage_engine: bool = True
) -> FastAPI:
    """The ASGI app. With manage_engine, the lifespan starts the engine thread and shuts it down."""
    serving = OpenAIServing(
        engine,
        settings.served_model_names,
        settings.model_root,
        settings.embedding_pooling,
        chat_template=settings.chat_template,
        chat_parsers=ChatParsers(settings.tool_call_parser, settings.reasoning_parser),
    )
    metrics = metrics or engine.metrics or EngineMetrics(settings.served_model_names[0], engine.stats)
    engine.metrics = metrics  # NOTE: the engine observes request latencies into the same registry
    feed = DashboardFeed(engine, metrics, settings.served_model_names[0], settings.dashboard_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        log_task = None
        if settings.log_stats_interval_s:
            log_task = asyncio.create_task(_log_stats(engine, settings.log_stats_interval_s))
        try:
            yield
        finally:
            if log_task is not None:
                log_task.cancel()
            await feed.close()
            if manage_engine:
                await engine.shutdown()

    app = FastAPI(title="tokenmill OpenAI-compatible server", version=tokenmill.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.dashboard = feed

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc, request.url.path)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _error_json(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else None
        return _error_response(
            exc.status_code, str(exc.detail), "invalid_request_error", code=kind, path=request.url.path
        )

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, (EngineDeadError, EngineNotReadyError)):
            return _error_json(engine_unavailable(exc), request.url.path)
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error_response(
            500, f"internal server error: {type(exc).__name__}", "server_error", path=request.url.path
        )

    def respond(result: tuple[dict[str, Any] | None, SSEStream | None]) -> Response:
        body, sse = result
        if sse is not None:
            return StreamingResponse(
                sse.body,
                media_type="text/event-stream",
                background=BackgroundTask(sse.close),
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return JSONResponse(body)

    async def generate(request: Request, is_stream: bool | None, work: Callable[[], Any]) -> Response:
        """A generating endpoint's answer: the SSE body at once when streaming, else the JSON body, cancelled (and
        aborted in the engine) if the client disconnects first."""
        if is_stream:
            return respond(await work())
        return await _cancel_on_disconnect(request, lambda: _json(work(), respond))

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_ERROR_RESPONSES, **_SSE_RESPONSE})
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await generate(request, body.stream, lambda: serving.create_completion(body))

    @app.post(
        "/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_ERROR_RESPONSES, **_SSE_RESPONSE}
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(request, body.stream, lambda: serving.create_chat_completion(body))

    @app.post(_EMBEDDINGS_PATH, response_model=EmbeddingResponse, responses=_ERROR_RESPONSES)
    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        return await generate(request, False, lambda: serving.create_embedding(body))

    responses = ResponsesServing(serving, ResponseStore(settings.responses_store_size))

    @app.post("/v1/responses", responses={**_ERROR_RESPONSES, **_SSE_RESPONSE})
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await generate(request, body.stream, lambda: responses.create(body))

    @app.get("/v1/responses/{response_id}", responses=_ERROR_RESPONSES)
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.get(response_id))

    @app.delete("/v1/responses/{response_id}", responses=_ERROR_RESPONSES)
    async def delete_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.delete(response_id))

    messages = MessagesServing(serving)

    @app.post("/v1/messages", responses={**_ERROR_RESPONSES, **_SSE_RESPONSE})
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        return await generate(request, body.stream, lambda: messages.create(body))

    @app.post("/v1/messages/count_tokens", responses=_ERROR_RESPONSES)
    async def count_message_tokens(body: CountTokensRequest) -> JSONResponse:
        return JSONResponse(await messages.count_tokens(body))

    @app.get("/v1/models", response_model=ModelList, responses=_ERROR_RESPONSES)
    async def list_models() -> ModelList:
        return serving.models()

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERROR_RESPONSES)
    async def get_model(model_id: str) -> ModelCard:
        name = serving.resolve_model(model_id)
        return next(card for card in serving.models().data if card.id == name)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse(await serving.tokenize(body))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(serving.detokenize(body))

    @app.post("/kv/plan", responses=_ERROR_RESPONSES)
    async def kv_plan(body: TokenizeRequest) -> JSONResponse:
        """For the router's conditional disaggregation: the prompt's length and how much of it this worker's
        prefix cache holds (a pure lookup on the engine thread)."""
        return JSONResponse(await serving.kv_plan(body))

    @app.get("/health", responses={503: _ERROR_RESPONSES[503]})
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tokenmill.__version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/kv_cache", responses=_ERROR_RESPONSES)
    async def debug_kv_cache() -> dict[str, Any]:
        """KV pool state from the engine thread; `integrity` runs check_integrity() when idle."""

        def probe(core: Any) -> dict[str, Any]:
            stats = core.stats()
            is_idle = not core.has_unfinished_requests()
            integrity = "skipped (requests in flight)"
            if is_idle:
                try:
                    core.check_integrity()
                    integrity = "ok"
                except AssertionError as e:
                    integrity = f"failed: {e}"
            return {
                "num_blocks_total": stats.num_blocks_total,
                "num_blocks_free": stats.num_blocks_free,
                "kv_cache_usage": stats.kv_cache_usage,
                "num_running": stats.num_running,
                "num_waiting": stats.num_waiting,
                "is_idle": is_idle,
                "integrity": integrity,
            }

        result = await engine.run_on_engine(probe)
        result["num_open_streams"] = engine.num_open_streams
        return result

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page_html(), headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/stream", include_in_schema=False)
    async def dashboard_stream() -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            yield "retry: 2000\n\n"
            async for text in feed.subscribe():
                yield f"data: {text}\n\n"

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    app.add_middleware(GateMiddleware, engine=engine, api_key=settings.api_key)
    return app


async def _json(coro: Any, respond: Callable) -> Response:
    return respond(await coro)


async def _log_stats(engine: AsyncEngine, interval_s: float) -> None:
    stat_logger = StatLogger(engine.stats, interval_s)
    while True:
        await asyncio.sleep(interval_s)
        try:
            stat_logger.log()
        except Exception:  # noqa: BLE001 - logging must never take the server down
            logger.exception("stats logging failed")


class _ReadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus read deadlines (see the module docstring); subclassed with the
    timeouts set by _with_read_timeouts. The deadline follows h11's view of the client: waiting
    for a request (IDLE, partial headers included), inside its body (SEND_BODY), or neither
    (request read: no deadline while the response is computed and sent)."""

    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None
        """What a read deadline runs for: "request headers", "request body" or nothing."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._update_read_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_read_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _update_read_timer(self) -> None:
        state = self.conn.their_state
        waiting_for = "request headers" if state is h11.IDLE else "request body" if state is h11.SEND_BODY else None
        if waiting_for == self._waiting_for:
            return  # NOTE: same phase: its deadline stands, so a client trickling bytes gains nothing
        self._cancel_read_timer()
        self._waiting_for = waiting_for
        if waiting_for is not None and not self.transport.is_closing():
            timeout = self.header_timeout_s if state is h11.IDLE else self.body_timeout_s
            self._read_timer = self.loop.call_later(timeout, self._on_read_timeout, timeout)

    def _on_read_timeout(self, timeout: float) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            logger.info(
                "closing the connection from %s: %s not received within %.0f s",
                f"{self.client[0]}:{self.client[1]:d}" if self.client else "?",
                self._waiting_for,
                timeout,
            )
            self.transport.close()


def _with_read_timeouts(header_timeout_s: float, body_timeout_s: float) -> type[H11Protocol]:
    return type(
        "ReadTimeoutH11Protocol",
        (_ReadTimeoutH11Protocol,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )


def serve(
    engine: AsyncEngine,
    settings: ServerSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    shutdown_timeout_s: float = 30.0,
    header_timeout_s: float = 30.0,
    body_timeout_s: float = 60.0,
) -> int:
    """Run uvicorn until SIGTERM/SIGINT; returns the exit code: 0, or 1 if the engine failed."""
    app = build_app(engine, settings)
    # NOTE: uvicorn's own grace timeout is only a backstop; ours (below) aborts what is left in the
    # engine first, so every stream ends with an error event and [DONE] instead of a cancelled task.
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=shutdown_timeout_s + 10,
        lifespan="on",
        http=_with_read_timeouts(header_timeout_s, body_timeout_s),
    )
    failed = False

    async def main() -> None:
        nonlocal failed
        loop = asyncio.get_running_loop()
        abort_timer: list[asyncio.TimerHandle] = []

        def on_exit_signal(sig: int) -> None:  # NOTE: runs in a signal handler; hop onto the loop
            def start_grace() -> None:
                if abort_timer:
                    return
                logger.info(
                    "%s: not accepting new connections; letting %d in-flight request(s) finish for up to %.0f s",
                    signal.Signals(sig).name,
                    engine.num_open_streams,
                    shutdown_timeout_s,
                )
                abort_timer.append(loop.call_later(shutdown_timeout_s, abort_in_flight))

            loop.call_soon_threadsafe(start_grace)

        def abort_in_flight() -> None:
            if engine.num_open_streams:
                logger.warning("grace period over: aborting %d in-flight request(s)", engine.num_open_streams)
            asyncio.ensure_future(engine.shutdown())

        server = _Server(config, on_exit_signal)

        async def watch_load() -> None:
            nonlocal failed
            try:
                await _wait_started(engine)
                await engine.wait_ready()
                logger.info(
                    "model loaded; serving %s on http://%s:%d", ", ".join(settings.served_model_names), host, port
                )
                app.state.serving.describe_chat_parsers()
            except EngineDeadError as e:
                logger.error("%s; shutting down", e)
                failed = True
                server.should_exit = True

        watcher = asyncio.create_task(watch_load())
        try:
            await server.serve()
        finally:
            watcher.cancel()
            for timer in abort_timer:
                timer.cancel()

    asyncio.run(main())
    if failed or engine.status.is_dead:
        return 1
    return 0


class _Server(uvicorn.Server):
    """uvicorn.Server whose SIGTERM/SIGINT start our grace period and end in exit status 0.

    NOTE: stock uvicorn re-raises the signal after a graceful shutdown, so the process would die
    with -SIGTERM; SIGTERM is tokenmill's normal way to stop, so it exits 0.
    """

    def __init__(self, config: uvicorn.Config, on_exit_signal: Callable[[int], None]) -> None:
        super().__init__(config)
        self._on_exit_signal = on_exit_signal

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self._handle_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def _handle_signal(self, sig: int, frame: object) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        else:
            self.should_exit = True
        self._on_exit_signal(sig)


async def _wait_started(engine: AsyncEngine) -> None:
    while not engine.is_started:  # NOTE: the lifespan hook starts it once uvicorn is up
        await asyncio.sleep(0.05)


__all__ = ["ServerSettings", "build_app", "serve"]
