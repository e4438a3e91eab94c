"""AsyncEngine against a small fake core (no model): threading, streaming, abort, errors, shutdown.

The real engine is exercised through the server tests; these pin the handoff logic itself.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.server.conftest import engine_stats
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError, EngineNotReadyError
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams


class FakeTokenizer:
    vocab_size = 100
    eos_token_id = 0

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


class FakeCore:
    """One token per step per request (token id = position); finishes at max_tokens."""

    def __init__(self, step_s: float = 0.0, fail_at_step: int | None = None, pause_after: int | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = 64
        self.vocab_size = FakeTokenizer.vocab_size
        self.hidden_size = 8
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int], float]] = {}
        self.thread_ids: set[int] = set()
        self.aborted: list[str] = []
        self.step_s = step_s
        self.num_steps = 0
        self.fail_at_step = fail_at_step
        self.num_generation_tokens = 0
        self.num_stats_calls = 0
        self.pause_after = pause_after
        """Steps after this many wait for `resume` (a reader can then take exactly the first outputs)."""
        self.resume = threading.Event()

    def _mark(self) -> None:
        self.thread_ids.add(threading.get_ident())

    def add_request(
        self, request_id, prompt_token_ids, params, prompt=None, arrival_time=None, cache_salt=None, kv_transfer=None
    ):
        self._mark()
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        self.requests[request_id] = (list(prompt_token_ids), params, [], arrival_time or time.time())

    def abort_request(self, request_id):
        self._mark()
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        self._mark()
        return bool(self.requests)

    def step(self):
        self._mark()
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("boom")
        if self.pause_after is not None and self.num_steps > self.pause_after:
            assert self.resume.wait(30), "the test never resumed the core"
        time.sleep(self.step_s)
        outs = []
        for rid, (prompt, params, toks, arrival) in list(self.requests.items()):
            toks.append(len(toks) + 1)
            self.num_generation_tokens += 1
            done = len(toks) >= params.max_tokens
            delta = params.output_kind == "delta"
            shown = toks[-1:] if delta else toks
            comp = CompletionOutput(
                0, self.tokenizer.decode(shown), list(shown), "length" if done else None, num_tokens=len(toks)
            )
            outs.append(
                RequestOutput(rid, None, prompt, [comp], done, RequestMetrics(arrival, arrival), is_delta=delta)
            )
            if done:
                del self.requests[rid]
        return outs

    def stats(self):
        self._mark()
        self.num_stats_calls += 1
        return engine_stats(num_running=len(self.requests), num_generation_tokens=self.num_generation_tokens)

    def check_integrity(self):
        self._mark()
        assert not self.requests


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _started(core: FakeCore, **kw) -> AsyncEngine:
    engine = AsyncEngine(core_factory=lambda: core, **kw)
    engine.start()
    await engine.wait_ready()
    return engine


def test_stream_runs_all_core_calls_on_one_background_thread():
    core = FakeCore()

    async def main():
        engine = await _started(core)
        outs = [o async for o in engine.generate([1, 2, 3], SamplingParams(max_tokens=4))]
        await engine.shutdown()
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [1, 2, 3, 4]
    assert all(not o.finished for o in outs[:-1])
    assert len(core.thread_ids) == 1 and threading.get_ident() not in core.thread_ids


def test_add_request_error_is_raised_to_the_caller():
    async def main():
        engine = await _started(FakeCore())
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request([], SamplingParams())
        assert engine.num_open_streams == 0
        await engine.shutdown()

    run(main())


def test_leaving_the_stream_early_aborts_the_request():
    core = FakeCore(step_s=0.01)

    async def main():
        engine = await _started(core)
        stream = await engine.add_request([5], SamplingParams(max_tokens=50), request_id="r1")
        async with stream:
            async for out in stream:
                if len(out.outputs[0].token_ids) >= 2:
                    break
        kv = await engine.run_on_engine(lambda c: (c.has_unfinished_requests(), list(c.aborted)))
        await engine.shutdown()
        return kv

    busy, aborted = run(main())
    assert not busy and aborted == ["r1"]


def test_cancelled_reader_aborts_the_request():
    core = FakeCore(step_s=0.01)

    async def main():
        engine = await _started(core)

        async def reader():
            async for _ in engine.generate([5], SamplingParams(max_tokens=1000), request_id="r2"):
                pass

        task = asyncio.create_task(reader())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        result = await engine.run_on_engine(lambda c: (c.has_unfinished_requests(), list(c.aborted)))
        await engine.shutdown()
        return result

    busy, aborted = run(main())
    assert not busy and aborted == ["r2"]


def test_slow_reader_skips_to_newest_cumulative_output():
    core = FakeCore()

    async def main():
        engine = await _started(core)
        stream = await engine.add_request([1], SamplingParams(max_tokens=20))
        while not stream.is_done_in_engine:  # the engine runs all 20 steps meanwhile
            await asyncio.sleep(0.01)
        outs = [o async for o in stream]
        await engine.shutdown()
        return outs

    outs = run(main())
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 20


def test_slow_reader_gets_deltas_joined_nothing_lost_nothing_repeated():
    core = FakeCore(pause_after=1)

    async def main():
        engine = await _started(core)
        stream = await engine.add_request([1], SamplingParams(max_tokens=20, output_kind="delta"))
        first = await stream.__anext__()  # the first token alone: the core waits before its second step
        core.resume.set()
        while not stream.is_done_in_engine:  # lag until the engine has handed over all 19 other tokens
            await asyncio.sleep(0.01)
        rest = [o async for o in stream]
        await engine.shutdown()
        return first, rest

    first, rest = run(main())
    assert len(rest) == 1 and rest[0].finished and rest[0].is_delta
    tokens = first.outputs[0].token_ids + rest[0].outputs[0].token_ids
    assert tokens == list(range(1, 21))
    assert first.outputs[0].text + rest[0].outputs[0].text == FakeTokenizer().decode(tokens)
    assert rest[0].outputs[0].num_tokens == 20


def test_stats_are_not_recomputed_after_every_step():
    """EngineStats walk every block: the engine thread takes a snapshot at most every STATS_REFRESH_S
    while stepping, and once more when it goes idle (so /metrics is current then)."""
    core = FakeCore(step_s=0.002)

    async def main():
        engine = await _started(core)
        streams = [await engine.add_request([1], SamplingParams(max_tokens=40)) for _ in range(4)]
        for s in streams:
            _ = [o async for o in s]
        while engine.stats().num_generation_tokens < 160:  # idle: one last snapshot
            await asyncio.sleep(0.01)
        stats = engine.stats()
        await engine.shutdown()
        return stats, engine.num_stats_snapshots

    stats, snapshots = run(main())
    assert core.num_steps >= 40
    assert core.num_stats_calls == snapshots < core.num_steps / 4
    assert stats.num_running == 0 and stats.num_generation_tokens == 160


def test_not_ready_and_load_failure():
    gate = threading.Event()

    def slow_factory():
        gate.wait(5)
        raise OSError("weights missing")

    async def main():
        engine = AsyncEngine(core_factory=slow_factory)
        engine.start()
        with pytest.raises(EngineNotReadyError):
            await engine.add_request([1], SamplingParams())
        assert not engine.status.is_ready and not engine.status.is_dead
        gate.set()
        with pytest.raises(EngineDeadError, match="weights missing"):
            await engine.wait_ready()
        assert engine.status.is_dead and "weights missing" in engine.status.error
        with pytest.raises(EngineDeadError):
            await engine.add_request([1], SamplingParams())
        await engine.shutdown()

    run(main())


def test_step_failure_fails_open_streams():
    async def main():
        engine = await _started(FakeCore(fail_at_step=3))
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in engine.generate([1], SamplingParams(max_tokens=10)):
                pass
        assert engine.status.is_dead
        await engine.shutdown()

    run(main())


def test_shutdown_aborts_in_flight_and_stops_the_thread():
    core = FakeCore(step_s=0.01)

    async def main():
        engine = await _started(core)
        stream = await engine.add_request([1], SamplingParams(max_tokens=1000), request_id="r3")
        await asyncio.sleep(0.05)
        await engine.shutdown()
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
        return engine

    engine = run(main())
    assert not engine._thread.is_alive()
    assert core.aborted == ["r3"] and not core.requests


def test_many_concurrent_streams():
    core = FakeCore()

    async def main():
        engine = await _started(core)

        async def one(i):
            last = None
            async for out in engine.generate([i + 1], SamplingParams(max_tokens=1 + i % 7)):
                last = out
            return last

        outs = await asyncio.gather(*[one(i) for i in range(200)])
        total = sum(1 + i % 7 for i in range(200))
        while engine.stats().num_generation_tokens < total:  # the engine thread's idle snapshot, taken after the
            await asyncio.sleep(0.01)  # last step: the streams may end before it
        stats = engine.stats()
        await engine.shutdown()
        return outs, stats

    outs, stats = run(main())
    assert [len(o.outputs[0].token_ids) for o in outs] == [1 + i % 7 for i in range(200)]
    assert stats.num_running == 0 and stats.num_generation_tokens == sum(1 + i % 7 for i in range(200))
