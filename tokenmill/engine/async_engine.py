"""AsyncEngine: the engine core on one background thread, requests as async streams.

Threads (see DESIGN.md, "Threads"): every torch call, model loading included, happens on the
single engine thread. The event-loop thread (the web server) never touches the core; it talks
to the engine thread through a command queue, and outputs come back in one batch per step:

    event loop                                   engine thread
    ----------                                   -------------
    add_request()  --Add-->  commands  --------> core.add_request()     (ValueError -> caller)
    stream.close() --Abort-> commands  --------> core.abort_request()   (blocks freed at once)
                                                 core.step()
    _dispatch(outputs, now) <------------------- loop.call_soon_threadsafe
      -> each RequestStream's queue

A slow reader gets what queued up merged into one output: the newest of cumulative outputs, or the
joined deltas (SamplingParams.output_kind "delta", what the server streams); nothing is lost or repeated.
Ordering: a command sent before another is handled before it; an Abort is handled before the next step starts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType, Protocol

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.distributed.kv_connector import KVTransferRequest
    from tokenmill.engine.stats import EngineStats
    from tokenmill.metrics import EngineMetrics
    from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

RequestId = NewType("RequestId", str)


class EngineCoreLike(Protocol):
    """What AsyncEngine needs of tokenmill.engine.core.EngineCore."""

    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    """Largest token id + 1 that the model accepts (its embedding rows)."""
    hidden_size: int
    """The size of the model's final hidden states: what an embedding (SamplingParams.pooling) holds."""

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer: KVTransferRequest | None = None,
    ) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> EngineStats: ...
    def snapshot(self, since_step: int = 0) -> Any: ...
    def check_integrity(self) -> None: ...


STATS_REFRESH_S = 0.5
"""While stepping, the engine thread recomputes EngineStats at most this often: its readers (/metrics,
the periodic log line) look every few seconds, and a snapshot walks every request's blocks."""


class EngineDeadError(RuntimeError):
    """The engine thread failed (model load or a step raised); no request can be served."""


class EngineNotReadyError(RuntimeError):
    """The model is still loading."""


# --- commands from the event loop to the engine thread -------------------------------------


@dataclass
class _Add:
    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float
    cache_salt: str | None
    kv_transfer: KVTransferRequest | None
    accepted: asyncio.Future  # set to None, or to the ValueError add_request raised


@dataclass
class _Abort:
    request_id: RequestId


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    result: asyncio.Future


@dataclass
class _Stop:
    pass


_Command = _Add | _Abort | _Call | _Stop


@dataclass
class _StreamState:
    """Per-request bookkeeping on the event loop (latency metrics)."""

    arrival_time: float
    num_tokens: int = 0
    last_token_time: float | None = None


class RequestStream:
    """Async iterator over one request's RequestOutputs (cumulative, or deltas with output_kind "delta");
    ends after the finished one.

    Leaving the iteration early (break, exception, cancellation on client disconnect) must be
    followed by close(), which aborts the request in the engine; `async with` does that.
    """

    def __init__(self, engine: AsyncEngine, request_id: RequestId, arrival_time: float) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self.state = _StreamState(arrival_time=arrival_time)
        self.is_finished = False
        """The reader has seen the finished output (or an error)."""
        self.is_done_in_engine = False
        """The engine reported the request finished; no abort is needed."""
        self._is_closed = False
        self._is_terminated = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        if self._is_terminated:
            return  # NOTE: nothing follows a finished output or an error
        self._is_terminated = isinstance(item, BaseException) or item.finished
        self._queue.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.is_finished or self._is_closed:
            raise StopAsyncIteration
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        # A reader that lagged gets what queued up as one output: cumulative outputs supersede each
        # other, deltas are joined (RequestOutput.merged); an error ends the stream.
        item = self._queue.popleft()
        while self._queue and not isinstance(item, BaseException):
            nxt = self._queue.popleft()
            item = nxt if isinstance(nxt, BaseException) else item.merged(nxt)
        if isinstance(item, BaseException):
            self.is_finished = True
            raise item
        if item.finished:
            self.is_finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it finished; idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        if not (self.is_finished or self.is_done_in_engine):
            self._engine._abort(self.request_id)
        self._engine._streams.pop(self.request_id, None)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class EngineStatus:
    """What the server shows on /health: is_ready, or the load / step error."""

    is_ready: bool
    is_dead: bool
    error: str | None = None


class AsyncEngine:
    """Runs an engine core on a background thread; requests become RequestStreams.

    Lifecycle: AsyncEngine(config) -> start() (returns at once; the model loads on the engine
    thread) -> wait_ready() -> add_request()/generate() ... -> shutdown().
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        core_factory: Callable[[], EngineCoreLike] | None = None,
        metrics: EngineMetrics | None = None,
        idle_poll_s: float = 1.0,
    ) -> None:
        if core_factory is None:
            if config is None:
                raise ValueError("AsyncEngine needs a config or a core_factory")

            def core_factory() -> EngineCoreLike:
                from tokenmill.engine.core import EngineCore

                return EngineCore(config)

        self.config = config
        self._core_factory = core_factory
        self.metrics = metrics
        self._idle_poll_s = idle_poll_s
        self._core: EngineCoreLike | None = None
        self._live_ids: set[RequestId] = set()  # NOTE: engine thread only
        self._commands: deque[_Command] = deque()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[RequestId, RequestStream] = {}
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._ready_waiters: list[asyncio.Future] = []
        self._stats: EngineStats | None = None
        self._stats_time = 0.0
        self._last_step_time = 0.0
        self.num_stats_snapshots = 0
        """EngineStats computed by the engine thread (at most one per STATS_REFRESH_S while stepping)."""
        self._counter = itertools.count()
        self._is_stopping = False
        # Filled on the engine thread once loaded; immutable afterwards.
        self.tokenizer: Tokenizer | None = None
        self.max_model_len: int | None = None
        self.vocab_size: int | None = None
        self.hidden_size: int | None = None

    # --- lifecycle (event loop) ------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; the model loads there. Call from the event loop."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    @property
    def is_started(self) -> bool:
        return self._thread is not None

    @property
    def status(self) -> EngineStatus:
        if self._error is not None:
            return EngineStatus(is_ready=False, is_dead=True, error=f"{type(self._error).__name__}: {self._error}")
        return EngineStatus(is_ready=self._ready.is_set(), is_dead=False)

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self._error is None

    async def wait_ready(self) -> None:
        """Wait until the model has loaded; raises EngineDeadError if loading failed."""
        if not self._ready.is_set() and self._error is None:
            fut = asyncio.get_running_loop().create_future()
            self._ready_waiters.append(fut)
            await fut
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error}") from self._error

    def stats(self) -> EngineStats | None:
        """Latest EngineStats snapshot taken by the engine thread (None before loading): at most
        STATS_REFRESH_S old while requests run, current when idle."""
        return self._stats

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight, stop the engine thread and wait for it (bounded)."""
        if self._thread is None:
            return
        self._is_stopping = True
        for stream in list(self._streams.values()):
            stream.is_done_in_engine = True  # NOTE: the Stop command aborts them all in the core
            stream._put(EngineDeadError("engine is shutting down"))
        self._streams.clear()
        self._send(_Stop())
        thread = self._thread
        deadline = time.monotonic() + timeout
        while thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if thread.is_alive():
            logger.warning("engine thread did not stop within %.0f s (still loading?)", timeout)

    # --- requests (event loop) -------------------------------------------------------------

    def new_request_id(self, prefix: str = "req") -> RequestId:
        return RequestId(f"{prefix}-{uuid.uuid4().hex[:16]}-{next(self._counter)}")

    async def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer: KVTransferRequest | None = None,
    ) -> RequestStream:
        """Hand a request to the engine; returns once the core accepted it.

        cache_salt: prefix-cache blocks are shared only between requests with the same salt.
        kv_transfer: disaggregation (distributed/kv_connector.py): hold the prompt's K/V, or pull them.

        Raises ValueError (the core's message) for a request the engine can never run,
        EngineNotReadyError while loading and EngineDeadError after a failure.
        """
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error}")
        if not self._ready.is_set():
            raise EngineNotReadyError("the model is still loading")
        if self._is_stopping:
            raise EngineDeadError("engine is shutting down")
        rid = RequestId(request_id or self.new_request_id())
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        arrival = time.time() if arrival_time is None else arrival_time
        stream = RequestStream(self, rid, arrival)
        self._streams[rid] = stream
        accepted = asyncio.get_running_loop().create_future()
        self._send(_Add(rid, list(prompt_token_ids), params, prompt, arrival, cache_salt, kv_transfer, accepted))
        try:
            error = await accepted
        except BaseException:
            # NOTE: cancelled while waiting (client gone): the Add may still land; abort after it.
            stream.close()
            raise
        if error is not None:
            self._streams.pop(rid, None)
            stream._is_closed = True
            raise error
        return stream

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Convenience: add a request and iterate its outputs; aborts it if the caller stops early."""
        stream = await self.add_request(prompt_token_ids, params, request_id=request_id, prompt=prompt)
        async with stream:
            async for out in stream:
                yield out

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(RequestId(request_id))
        if stream is not None:
            stream.close()
        else:
            self._send(_Abort(RequestId(request_id)))  # NOTE: unknown or finished: a no-op in the core

    async def run_on_engine(self, fn: Callable[[EngineCoreLike], Any]) -> Any:
        """Run fn(core) on the engine thread between two steps and return its result."""
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error}")
        if not self._ready.is_set():
            raise EngineNotReadyError("the model is still loading")
        fut = asyncio.get_running_loop().create_future()
        self._send(_Call(fn, fut))
        return await fut

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    def _abort(self, request_id: RequestId) -> None:
        if self.metrics is not None:
            self.metrics.observe_aborted()
        self._send(_Abort(request_id))

    def _send(self, cmd: _Command) -> None:
        self._commands.append(cmd)  # NOTE: deque.append/popleft are thread-safe
        self._wakeup.set()

    # --- engine thread -------------------------------------------------------------------------

    def _to_loop(self, fn: Callable, *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass

    def _run(self) -> None:
        name_os_thread("tokenmill-engine")
        try:
            core = self._core_factory()
            self.tokenizer = core.tokenizer
            self.max_model_len = core.max_model_len
            self.vocab_size = core.vocab_size
            self.hidden_size = core.hidden_size
            self._core = core
            self._snapshot(core, time.time())
        except BaseException as e:  # noqa: BLE001 - reported to every waiter and /health
            logger.exception("engine failed to load the model")
            self._error = e
            self._to_loop(self._on_loaded)
            return
        self._ready.set()
        self._to_loop(self._on_loaded)
        try:
            self._loop_steps(core)
        except BaseException as e:  # noqa: BLE001
            logger.exception("engine step loop failed")
            self._error = e
            self._fail_pending_commands(EngineDeadError(f"engine failed: {e}"))
            self._to_loop(self._fail_all, e)

    def _loop_steps(self, core: EngineCoreLike) -> None:
        while True:
            changed = False
            while self._commands:
                cmd = self._commands.popleft()
                if isinstance(cmd, _Stop):
                    self._abort_everything(core)
                    return
                self._handle(core, cmd)
                changed = True
            if core.has_unfinished_requests():
                outputs = core.step()
                now = self._last_step_time = time.time()
                for out in outputs:
                    if out.finished:
                        self._live_ids.discard(RequestId(out.request_id))
                if now - self._stats_time >= STATS_REFRESH_S:
                    self._snapshot(core, now)
                self._to_loop(self._dispatch, outputs, now)
                continue
            if changed or self._stats_time < self._last_step_time:  # idle: the snapshot is current
                self._snapshot(core, time.time())
            self._wakeup.wait(self._idle_poll_s)
            self._wakeup.clear()

    def _snapshot(self, core: EngineCoreLike, now: float) -> None:
        """Recompute EngineStats (it walks every request's blocks: not after every step)."""
        self._stats = core.stats()
        self._stats_time = now
        self.num_stats_snapshots += 1

    def _handle(self, core: EngineCoreLike, cmd: _Command) -> None:
        if isinstance(cmd, _Add):
            try:
                core.add_request(
                    cmd.request_id,
                    cmd.prompt_token_ids,
                    cmd.params,
                    prompt=cmd.prompt,
                    arrival_time=cmd.arrival_time,
                    cache_salt=cmd.cache_salt,
                    kv_transfer=cmd.kv_transfer,
                )
                self._live_ids.add(cmd.request_id)
                error = None
            except (ValueError, TypeError) as e:
                error = e
            self._to_loop(_resolve, cmd.accepted, error)
        elif isinstance(cmd, _Abort):
            core.abort_request(cmd.request_id)
            self._live_ids.discard(cmd.request_id)
        elif isinstance(cmd, _Call):
            try:
                result, exc = cmd.fn(core), None
            except Exception as e:  # noqa: BLE001 - handed back to the caller
                result, exc = None, e
            self._to_loop(_resolve_call, cmd.result, result, exc)

    def _fail_pending_commands(self, error: BaseException) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, _Add):
                self._to_loop(_fail, cmd.accepted, error)
            elif isinstance(cmd, _Call):
                self._to_loop(_fail, cmd.result, error)

    def _abort_everything(self, core: EngineCoreLike) -> None:
        self._fail_pending_commands(EngineDeadError("engine is shutting down"))
        for rid in self._live_ids:
            core.abort_request(rid)
        self._live_ids.clear()
        self._snapshot(core, time.time())

    # --- back on the event loop ------------------------------------------------------------------

    def _on_loaded(self) -> None:
        for fut in self._ready_waiters:
            if not fut.done():
                fut.set_result(None)
        self._ready_waiters.clear()

    def _fail_all(self, error: BaseException) -> None:
        dead = EngineDeadError(f"engine failed: {error}")
        for stream in list(self._streams.values()):
            stream._put(dead)
        self._streams.clear()

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        metrics = self.metrics
        for out in outputs:
            stream = self._streams.get(RequestId(out.request_id))
            if stream is None:
                continue  # aborted by its reader; the core forgets it at the next command
            if metrics is not None:
                _observe(metrics, stream.state, out, now)
            stream._put(out)
            if out.finished:
                stream.is_done_in_engine = True
                self._streams.pop(stream.request_id, None)


def _observe(metrics: EngineMetrics, state: _StreamState, out: RequestOutput, now: float) -> None:
    """Latency bookkeeping: TTFT on the first token, one ITL sample per step that added tokens."""
    num_tokens = (
        state.num_tokens + sum(len(c.token_ids) for c in out.outputs)
        if out.is_delta
        else sum(c.num_tokens for c in out.outputs)
    )
    if num_tokens > state.num_tokens:
        if state.last_token_time is None:
            metrics.observe_ttft(now - state.arrival_time)
        else:
            metrics.observe_itl(now - state.last_token_time)
        state.num_tokens = num_tokens
        state.last_token_time = now
    if out.finished:
        metrics.observe_finished(
            e2e=now - state.arrival_time,
            timings=out.metrics,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_generation_tokens=num_tokens,
            finish_reasons=[c.finish_reason or "abort" for c in out.outputs],
        )


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux, 15 characters), shown by `top -H` and /proc: Python
    3.11 names threads for Python only. Threads it starts later (torch's OpenMP workers) inherit it."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass  # not Linux: the name is cosmetic


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    if not fut.done():
        fut.set_result(error)


def _resolve_call(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _fail(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
