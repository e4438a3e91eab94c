"""The worker half of the KV connector (distributed/kv_connector.py) and the transports that move the blocks.

The worker half owns nothing but a view of the KV cache ([num_layers] x [2, num_blocks, block_size,
num_kv_heads, cache_head_dim]: int8 caches carry their scales in the last dimension, so they travel with
them) and a transport. All tensor work (gathering held blocks, scattering pulled ones) happens on the
engine thread, in `start_step`; transports only move finished tensors and run their waits on their own
threads.

A pull's wire format is one tensor per transfer, [num_layers, 2, num_blocks, block_size, num_kv_heads,
cache_head_dim] in the cache dtype: both sides must run the same model with the same block size and KV
dtype, which the pull checks by shape (a mismatch fails the pull, and the decode side recomputes).

Transports:

* `InProcessTransport`: endpoints of one `InProcessHub` in one process (unit tests): a pull is served when
  the holder's engine next steps.
* `GlooTransport`: torch.distributed. A prefill worker hosts a TCPStore at its KV endpoint (host, port), as
  torchrun's rendezvous does; a decode worker opens a session to it: it takes a session number from the
  store and both sides build a two-rank ProcessGroupGloo under that session's key prefix (decode rank 1,
  prefill rank 0). Pull requests and their acknowledgements go through the store; the blocks go by gloo
  send/recv. A session whose peer died (its ops raise) is dropped; the next pull opens a new one, so a
  restarted worker is reached again without restarting the other.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple, Protocol

import torch

from tokenmill.distributed.kv_connector import (
    ConnectorEvents,
    ConnectorStats,
    ConnectorStep,
    KVHold,
    KVLoad,
    PullFromPrefill,
)

logger = logging.getLogger("tokenmill.kv_transfer")


@dataclass(frozen=True)
class PullRequest:
    """A decode worker asks for blocks of a held transfer."""

    transfer_id: str
    first_block: int
    num_blocks: int
    shape: tuple[int, ...]
    """The tensor the puller expects: [num_layers, 2, num_blocks, block_size, num_kv_heads, cache_head_dim]."""
    dtype: str
    reply_to: object
    """The transport's handle for the answer (opaque to the worker half)."""


@dataclass(frozen=True)
class LoadDone:
    request_id: str
    ok: bool
    error: str | None = None


@dataclass(frozen=True)
class SendDone:
    transfer_id: str
    ok: bool
    num_bytes: int
    seconds: float
    error: str | None = None


@dataclass
class TransportEvents:
    pulls: list[PullRequest] = field(default_factory=list)
    """Pulls this side must answer (it holds blocks)."""
    loads: list[LoadDone] = field(default_factory=list)
    """Pulls this side made that ended (their buffer is filled when ok)."""
    sends: list[SendDone] = field(default_factory=list)


class KVTransport(Protocol):
    """Moves block tensors between workers. Methods are called on the engine thread."""

    @property
    def address(self) -> tuple[str, int] | None:
        """Where decode workers pull this worker's held blocks from (None: it holds none)."""

    def pull(
        self, request_id: str, source: PullFromPrefill, first_block: int, num_blocks: int, into: torch.Tensor
    ) -> None:
        """Start pulling into `into` (filled when a LoadDone for request_id reports ok)."""

    def answer(self, pull: PullRequest, data: torch.Tensor | None, error: str | None) -> None:
        """Send `data` for a pull (or refuse it with `error`); a SendDone follows."""

    def poll(self) -> TransportEvents: ...

    @property
    def has_events(self) -> bool:
        """Something arrived that `poll` would return (a pull to answer wakes an idle engine)."""

    def wait(self, timeout_s: float) -> None:
        """Block until an event may be ready or timeout_s passed."""

    def abandon(self, source: PullFromPrefill) -> None:
        """Give up on the connection to this prefill worker (a pull ran past its deadline): the next pull opens a
        new one; whatever the old one still delivers is ignored."""

    def close(self) -> None: ...


class KVConnectorWorker:
    """Applies the scheduler half's `ConnectorStep` to the KV cache and reports `ConnectorEvents`."""

    def __init__(
        self, kv_caches: list[torch.Tensor], transport: KVTransport, stats: ConnectorStats, timeout_s: float = 30.0
    ) -> None:
        """timeout_s: a pull not finished by then fails here, whatever the transport is still waiting on (a TCP
        store whose host is frozen answers nothing, and its client waits for it indefinitely)."""
        self.kv_caches = kv_caches  # [num_layers] x [2, num_blocks, block_size, num_kv_heads, cache_head_dim]
        self.transport = transport
        self.timeout_s = timeout_s
        self.stats = stats
        self.held: dict[str, KVHold] = {}
        """Transfer id -> the blocks it may serve, until its deadline."""
        self.loads: dict[str, tuple[KVLoad, torch.Tensor, float]] = {}
        """Request id -> (the load, its buffer, start time) while its pull runs."""
        self.sends_started: dict[str, float] = {}
        self.events = ConnectorEvents()

    def buffer_shape(self, num_blocks: int) -> tuple[int, ...]:
        c = self.kv_caches[0]
        return (len(self.kv_caches), 2, num_blocks, *c.shape[2:])

    @property
    def has_pending_io(self) -> bool:
        return bool(self.loads or self.sends_started) or self.transport.has_events

    def start_step(self, step: ConnectorStep) -> None:
        """Before a step's forward: forget cancelled loads and released holds, take new holds, answer pulls,
        place finished loads, start new pulls."""
        for rid in step.cancelled:
            self.loads.pop(rid, None)
        for h in step.holds:  # before releases: a hold taken and expired since the last step is in both
            self.held[h.transfer_id] = h
        for tid in step.releases:
            self.held.pop(tid, None)
        self.collect()
        for load in step.loads:
            buf = torch.empty(self.buffer_shape(len(load.block_ids)), dtype=self.kv_caches[0].dtype)
            self.loads[load.request_id] = (load, buf, time.perf_counter())
            self.transport.pull(load.request_id, load.source, load.first_block, len(load.block_ids), buf)

    def collect(self) -> None:
        """Handle what the transport finished: answer pulls from held blocks, scatter loads, count sends."""
        ev = self.transport.poll()
        for p in ev.pulls:
            self._answer(p)
        for d in ev.loads:
            entry = self.loads.pop(d.request_id, None)
            if entry is None:
                continue  # cancelled: the request left
            load, buf, t0 = entry
            if d.ok:
                idx = torch.tensor(load.block_ids, dtype=torch.long, device=self.kv_caches[0].device)
                for layer, cache in enumerate(self.kv_caches):
                    cache.index_copy_(1, idx, buf[layer].to(cache.device))
                self.stats.num_blocks_loaded += len(load.block_ids)
                self.stats.bytes_loaded += buf.numel() * buf.element_size()
            else:
                logger.warning("KV pull for %s failed (%s): recomputing its prompt here", d.request_id, d.error)
            self.stats.load_seconds += time.perf_counter() - t0
            self.events.loads_done[d.request_id] = d.ok
        now = time.perf_counter()
        for rid, (load, _, t0) in list(self.loads.items()):
            if now - t0 > self.timeout_s:
                logger.warning(
                    "KV pull for %s from %s:%d ran past %.1f s: recomputing its prompt here",
                    rid,
                    load.source.host,
                    load.source.port,
                    self.timeout_s,
                )
                del self.loads[rid]
                self.transport.abandon(load.source)
                self.stats.load_seconds += now - t0
                self.events.loads_done[rid] = False
        for s in ev.sends:
            self.sends_started.pop(s.transfer_id, None)
            if s.ok:
                self.stats.num_sends += 1
                self.stats.bytes_sent += s.num_bytes
                self.stats.send_seconds += s.seconds
            self.events.sends_done.append(s.transfer_id)

    def _answer(self, p: PullRequest) -> None:
        hold = self.held.get(p.transfer_id)
        if hold is None or time.monotonic() > hold.deadline:  # a pull that came late (this process was stalled)
            self.transport.answer(p, None, f"transfer {p.transfer_id!r} is not held here (expired or unknown)")
            return
        blocks = hold.block_ids
        if p.first_block + p.num_blocks > len(blocks) or p.first_block < 0:
            self.transport.answer(
                p,
                None,
                f"transfer {p.transfer_id!r} holds {len(blocks)} blocks, pull asked for "
                f"{p.first_block}..{p.first_block + p.num_blocks - 1}",
            )
            return
        want = self.buffer_shape(p.num_blocks)
        if tuple(p.shape) != want or p.dtype != str(self.kv_caches[0].dtype):
            self.transport.answer(
                p,
                None,
                f"KV layout differs: the puller expects {tuple(p.shape)} {p.dtype}, this "
                f"worker has {want} {self.kv_caches[0].dtype} (same model, block size "
                f"and kv_cache_dtype on both sides?)",
            )
            return
        idx = torch.tensor(
            blocks[p.first_block : p.first_block + p.num_blocks], dtype=torch.long, device=self.kv_caches[0].device
        )
        data = torch.stack([c.index_select(1, idx) for c in self.kv_caches]).cpu()
        self.sends_started[p.transfer_id] = time.perf_counter()
        self.stats.num_blocks_sent += p.num_blocks
        self.transport.answer(p, data, None)

    def take_events(self) -> ConnectorEvents:
        out, self.events = self.events, ConnectorEvents()
        return out

    def wait(self, timeout_s: float) -> None:
        self.transport.wait(timeout_s)


# ------------------------------------------------------------------------------- in one process
class InProcessHub:
    """Endpoints that reach each other by address within one process (tests drive two engines in turn)."""

    def __init__(self) -> None:
        self.endpoints: dict[tuple[str, int], InProcessTransport] = {}

    def endpoint(self, port: int) -> InProcessTransport:
        t = InProcessTransport(self, ("inprocess", port))
        self.endpoints[t.address] = t
        return t


@dataclass(frozen=True)
class _InProcessReply:
    transport: InProcessTransport
    request_id: str
    into: torch.Tensor


class InProcessTransport:
    def __init__(self, hub: InProcessHub, address: tuple[str, int]) -> None:
        self.hub = hub
        self._address = address
        self.events = TransportEvents()

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    def pull(
        self, request_id: str, source: PullFromPrefill, first_block: int, num_blocks: int, into: torch.Tensor
    ) -> None:
        peer = self.hub.endpoints.get((source.host, source.port))
        if peer is None:
            self.events.loads.append(LoadDone(request_id, False, f"no KV endpoint at {source.host}:{source.port}"))
            return
        peer.events.pulls.append(
            PullRequest(
                source.transfer_id,
                first_block,
                num_blocks,
                tuple(into.shape),
                str(into.dtype),
                _InProcessReply(self, request_id, into),
            )
        )

    def answer(self, pull: PullRequest, data: torch.Tensor | None, error: str | None) -> None:
        reply: _InProcessReply = pull.reply_to
        if data is not None:
            reply.into.copy_(data)
        reply.transport.events.loads.append(LoadDone(reply.request_id, data is not None, error))
        n = 0 if data is None else data.numel() * data.element_size()
        self.events.sends.append(SendDone(pull.transfer_id, data is not None, n, 0.0, error))

    def poll(self) -> TransportEvents:
        out, self.events = self.events, TransportEvents()
        return out

    @property
    def has_events(self) -> bool:
        e = self.events
        return bool(e.pulls or e.loads or e.sends)

    def wait(self, timeout_s: float) -> None:
        pass

    def abandon(self, source: PullFromPrefill) -> None:
        pass

    def close(self) -> None:
        self.hub.endpoints.pop(self._address, None)


# ------------------------------------------------------------------------------- torch.distributed
POLL_S = 0.2
"""How long an idle sender or puller thread waits for work before checking whether it should stop."""
PULL_POLL_S = 0.001
"""How often a prefill-side session thread looks for the next pull in the store (a non-blocking check)."""


def _store(host: str, port: int, timeout_s: float, is_master: bool = False):
    """A TCPStore client (or, is_master, the store itself) whose waits and gets time out after timeout_s."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def _group(store, prefix: str, rank: int, timeout_s: float):
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, timedelta(seconds=timeout_s))


@dataclass(frozen=True)
class _GlooReply:
    session: _ServerSession
    index: int


class _ServerSession:
    """Prefill side: one decode worker's session. A thread reads its pulls from the store; answers are sent by
    a second thread so a slow receiver never delays reading the next pull."""

    def __init__(self, transport: GlooTransport, number: int) -> None:
        self.transport = transport
        self.number = number
        self.outbox: queue.Queue = queue.Queue()
        self.alive = True
        threading.Thread(target=self._run, name=f"kv-session-{number}", daemon=True).start()

    def _run(self) -> None:
        t = self.transport
        try:
            store = _store(t.host, t.port, POLL_S)
            pg = _group(store, f"s{self.number}/", 0, t.timeout_s)
        except Exception as e:  # noqa: BLE001 - the peer went away before the group formed
            logger.warning("KV session %d did not form: %s", self.number, e)
            self.alive = False
            return
        threading.Thread(target=self._send_loop, args=(store, pg), name=f"kv-send-{self.number}", daemon=True).start()
        i = 0
        while self.alive and not t.closed:
            key = f"s{self.number}/pull/{i}"
            try:
                if not store.check([key]):
                    time.sleep(PULL_POLL_S)
                    continue
                msg = json.loads(store.get(key))
            except Exception as e:  # noqa: BLE001 - the store is gone (this worker is closing)
                logger.warning("KV session %d: store unreadable (%s); closing it", self.number, e)
                self.alive = False
                return
            t.push_pull(
                PullRequest(
                    msg["transfer_id"],
                    msg["first_block"],
                    msg["num_blocks"],
                    tuple(msg["shape"]),
                    msg["dtype"],
                    _GlooReply(self, i),
                )
            )
            i += 1

    def _send_loop(self, store, pg) -> None:
        ack_store = _store(self.transport.host, self.transport.port, self.transport.timeout_s)
        while self.alive and not self.transport.closed:
            try:
                item = self.outbox.get(timeout=POLL_S)
            except queue.Empty:
                continue
            index, transfer_id, data, error = item.index, item.transfer_id, item.data, item.error
            t0 = time.perf_counter()
            try:
                ack_store.set(f"s{self.number}/ack/{index}", "ok" if error is None else f"error: {error}")
                if data is not None:
                    pg.send([data], 1, index + 1).wait()
                n = 0 if data is None else data.numel() * data.element_size()
                self.transport.push_send(SendDone(transfer_id, data is not None, n, time.perf_counter() - t0, error))
            except Exception as e:  # noqa: BLE001 - the decode worker died mid-transfer
                logger.warning(
                    "KV session %d: send of %s failed (%s); dropping the session", self.number, transfer_id, e
                )
                self.alive = False
                self.transport.push_send(SendDone(transfer_id, False, 0, time.perf_counter() - t0, str(e)))
        while True:  # whatever is still queued fails: its holds end
            try:
                item = self.outbox.get_nowait()
            except queue.Empty:
                break
            self.transport.push_send(SendDone(item.transfer_id, False, 0, 0.0, "session closed"))


class _PullJob(NamedTuple):
    request_id: str
    source: PullFromPrefill
    first_block: int
    num_blocks: int
    into: torch.Tensor


class _Answer(NamedTuple):
    index: int
    transfer_id: str
    data: torch.Tensor | None
    error: str | None


class _ClientSession:
    """Decode side: a session to one prefill worker; its thread runs the pulls in order."""

    def __init__(self, transport: GlooTransport, host: str, port: int) -> None:
        self.transport = transport
        self.host, self.port = host, port
        self.jobs: queue.Queue = queue.Queue()
        self.alive = True
        self._lock = threading.Lock()  # submit vs _fail_all: no job is queued on a session that has failed
        threading.Thread(target=self._run, name=f"kv-pull-{host}:{port}", daemon=True).start()

    def submit(self, job: _PullJob) -> bool:
        """Queue a pull; False if the session has failed (the caller opens a new one)."""
        with self._lock:
            if not self.alive:
                return False
            self.jobs.put(job)
            return True

    def abandon(self) -> None:
        """Stop taking jobs; the thread may stay blocked on a frozen peer (a daemon: it dies with the process)."""
        with self._lock:
            self.alive = False

    def _fail_all(self, first: _PullJob | None, error: str) -> None:
        with self._lock:
            self.alive = False
        logger.warning("%s", error)
        pending = [first] if first is not None else []
        while True:
            try:
                pending.append(self.jobs.get_nowait())
            except queue.Empty:
                break
        for job in pending:
            self.transport.push_load(LoadDone(job.request_id, False, error))

    def _run(self) -> None:
        t = self.transport
        job = None
        try:
            store = _store(self.host, self.port, t.timeout_s)
            number = store.add("sessions", 1)
            pg = _group(store, f"s{number}/", 1, t.timeout_s)
        except Exception as e:  # noqa: BLE001 - no prefill worker there
            self._fail_all(None, f"cannot reach the KV endpoint {self.host}:{self.port}: {e}")
            return
        i = 0
        while not t.closed and self.alive:
            try:
                job = self.jobs.get(timeout=POLL_S)
            except queue.Empty:
                continue
            try:
                store.set(
                    f"s{number}/pull/{i}",
                    json.dumps(
                        {
                            "transfer_id": job.source.transfer_id,
                            "first_block": job.first_block,
                            "num_blocks": job.num_blocks,
                            "shape": list(job.into.shape),
                            "dtype": str(job.into.dtype),
                        }
                    ),
                )
                ack = store.get(f"s{number}/ack/{i}").decode()
                if ack != "ok":
                    t.push_load(LoadDone(job.request_id, False, ack.removeprefix("error: ")))
                else:
                    pg.recv([job.into], 0, i + 1).wait()
                    t.push_load(LoadDone(job.request_id, True))
                i += 1
            except Exception as e:  # noqa: BLE001 - the prefill worker died or timed out
                self._fail_all(job, f"KV pull from {self.host}:{self.port} failed: {e}")
                return


class GlooTransport:
    """See the module docstring. `serve`: host the store at (host, port) and answer pulls (prefill role)."""

    def __init__(self, host: str, port: int, serve: bool, timeout_s: float = 30.0) -> None:
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self.closed = False
        self._events = TransportEvents()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._clients: dict[tuple[str, int], _ClientSession] = {}
        self._store = None
        if serve:
            self._store = _store(host, port, POLL_S, is_master=True)
            self.port = self._store.port
            self._store.add("sessions", 0)
            threading.Thread(target=self._accept, name="kv-accept", daemon=True).start()

    @property
    def address(self) -> tuple[str, int] | None:
        return (self.host, self.port) if self._store is not None else None

    def _accept(self) -> None:
        store = _store(self.host, self.port, POLL_S)
        seen = 0
        while not self.closed:
            n = store.add("sessions", 0)
            for number in range(seen + 1, n + 1):
                _ServerSession(self, number)
            seen = max(seen, n)
            time.sleep(0.02)

    # --- called from session threads
    def push_pull(self, p: PullRequest) -> None:
        with self._lock:
            self._events.pulls.append(p)
        self._ready.set()

    def push_load(self, d: LoadDone) -> None:
        with self._lock:
            self._events.loads.append(d)
        self._ready.set()

    def push_send(self, s: SendDone) -> None:
        with self._lock:
            self._events.sends.append(s)
        self._ready.set()

    # --- called on the engine thread
    def pull(
        self, request_id: str, source: PullFromPrefill, first_block: int, num_blocks: int, into: torch.Tensor
    ) -> None:
        key = (source.host, source.port)
        job = _PullJob(request_id, source, first_block, num_blocks, into)
        session = self._clients.get(key)
        if session is None or not session.submit(job):
            session = self._clients[key] = _ClientSession(self, *key)
            session.submit(job)

    def answer(self, pull: PullRequest, data: torch.Tensor | None, error: str | None) -> None:
        reply: _GlooReply = pull.reply_to
        if not reply.session.alive:
            self.push_send(SendDone(pull.transfer_id, False, 0, 0.0, "session closed"))
            return
        reply.session.outbox.put(_Answer(reply.index, pull.transfer_id, data, error))

    def abandon(self, source: PullFromPrefill) -> None:
        session = self._clients.pop((source.host, source.port), None)
        if session is not None:
            session.abandon()

    def poll(self) -> TransportEvents:
        with self._lock:
            out, self._events = self._events, TransportEvents()
            self._ready.clear()
        return out

    @property
    def has_events(self) -> bool:
        with self._lock:
            e = self._events
            return bool(e.pulls or e.loads or e.sends)

    def wait(self, timeout_s: float) -> None:
        self._ready.wait(timeout_s)

    def close(self) -> None:
        self.closed = True
