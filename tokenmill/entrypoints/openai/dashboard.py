"""The live dashboard: GET /dashboard (one self-contained page) and GET /dashboard/stream (SSE).

    page (browser)  <--- SSE, one JSON update per interval ---  DashboardFeed (event loop)
                                                                  | while a page is open:
                                                                  | run_on_engine(core.snapshot(since_step))
                                                                  v
                                                                engine thread, between two steps

The feed samples the engine only while at least one stream is open, at most 1 / interval_s times a second,
and all open pages share each sample. A sample is taken on the engine thread between two steps (so the block
map, the stats and the request list agree with each other); building it walks the pool once. Each update
carries the steps that ran since the previous one, so the page's step chart misses none while the engine
remembers them (STEP_LOG_LEN).

With --api-key the page and its stream are protected like the API: a Bearer header, or the cookie that
`/dashboard?api_key=<key>` sets (a browser cannot send a header on navigation or EventSource). The cookie holds
an HMAC of the key, not the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import operator
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.stats import EngineSnapshot
from tokenmill.metrics import EngineMetrics

logger = logging.getLogger("tokenmill.dashboard")

COOKIE_NAME = "tokenmill_dashboard"
LATENCY_PERCENTILES = (50, 90, 99)


def dashboard_cookie(api_key: str) -> str:
    """The cookie value that stands for the API key on /dashboard (an HMAC: the key itself never leaves)."""
    return hmac.new(api_key.encode(), b"tokenmill dashboard", hashlib.sha256).hexdigest()


def page_html() -> str:
    return resources.files("tokenmill.entrypoints.openai").joinpath("dashboard.html").read_text(encoding="utf-8")


def block_ranges(block_ids: list[int]) -> list[list[int]]:
    """A block table as [first id, count] runs: [4, 5, 6, 9, 2] -> [[4, 3], [9, 1], [2, 1]]."""
    runs: list[list[int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return runs


class DashboardFeed:
    """Samples the engine for the open dashboards and hands each of them every update (JSON text)."""

    def __init__(self, engine: AsyncEngine, metrics: EngineMetrics, model_name: str, interval_s: float = 0.5) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.interval_s = interval_s
        self.num_samples = 0
        """Engine snapshots taken: zero while no page is open (the test of "costs nothing when closed")."""
        self._queues: set[asyncio.Queue[str]] = set()
        self._task: asyncio.Task | None = None
        self._last_step = 0
        self._prev: tuple[float, float, float, float, float] | None = None
        # (monotonic time, generation tokens, prompt tokens, prefix queries, prefix hits) at the last sample

    @property
    def num_subscribers(self) -> int:
        return len(self._queues)

    async def subscribe(self) -> AsyncIterator[str]:
        """Update texts (JSON) for one page, the first at once, until the caller stops iterating."""
        queue: asyncio.Queue[str] = asyncio.Queue(maxsize=4)
        self._queues.add(queue)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            while True:
                yield await queue.get()
        finally:
            self._queues.discard(queue)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _run(self) -> None:
        while self._queues:
            t0 = time.monotonic()
            try:
                since = self._last_step
                # core.snapshot(since) on the engine thread
                snap: EngineSnapshot = await self.engine.run_on_engine(operator.methodcaller("snapshot", since))
            except Exception as e:  # noqa: BLE001 - engine dead or still loading: the page says so
                text = json.dumps({"error": f"{type(e).__name__}: {e}"})
            else:
                self.num_samples += 1
                text = json.dumps(self.update(snap, time.monotonic()), separators=(",", ":"))
            for q in list(self._queues):
                if q.full():  # a slow page skips an update rather than holding memory
                    q.get_nowait()
                q.put_nowait(text)
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def update(self, snap: EngineSnapshot, now: float) -> dict[str, Any]:
        """One update's content: every number the page shows, from one snapshot and the latency windows."""
        st = snap.stats
        if snap.steps:
            self._last_step = snap.steps[-1].index
        gen, prompt = float(st.num_generation_tokens), float(st.num_prompt_tokens)
        queries, hits = float(st.prefix_cache_queries), float(st.prefix_cache_hits)
        rates = {"generation_tps": 0.0, "prompt_tps": 0.0, "prefix_hit_rate_recent": None}
        if self._prev is not None:
            t, g0, p0, q0, h0 = self._prev
            dt = max(now - t, 1e-6)
            rates["generation_tps"] = (gen - g0) / dt
            rates["prompt_tps"] = (prompt - p0) / dt
            if queries > q0:
                rates["prefix_hit_rate_recent"] = (hits - h0) / (queries - q0)
        self._prev = (now, gen, prompt, queries, hits)
        spec = st.spec_decode or {}
        per_pos = sorted(
            (int(k.removeprefix("num_accepted_tokens_per_pos_")), v)
            for k, v in spec.items()
            if k.startswith("num_accepted_tokens_per_pos_")
        )
        num_drafts = spec.get("num_drafts", 0.0)
        m = self.metrics
        return {
            "model": self.model_name,
            "time": time.time(),
            "counters": {
                "generation_tokens": st.num_generation_tokens,
                "prompt_tokens": st.num_prompt_tokens,
                "prefix_cache_queries": st.prefix_cache_queries,
                "prefix_cache_hits": st.prefix_cache_hits,
                "preemptions": st.num_preemptions,
                "engine_steps": st.num_steps,
                "requests_finished": m.num_finished,
            },
            "gauges": {
                "running": st.num_running,
                "waiting": st.num_waiting,
                "preempted": sum(r.status == "PREEMPTED" for r in snap.requests),
                "kv_cache_usage": st.kv_cache_usage,
                "blocks_total": st.num_blocks_total,
                "blocks_free": st.num_blocks_free,
                "blocks_cached_free": st.num_blocks_cached_free,
                "blocks_used": st.num_blocks_used,
                "blocks_shared": st.num_blocks_shared,
                "block_size": st.block_size,
                "kv_cache_dtype": st.kv_cache_dtype,
            },
            "rates": {**rates, "prefix_hit_rate": hits / queries if queries else None},
            "latency": {
                "ttft": m.ttft_window.percentiles(LATENCY_PERCENTILES),
                "itl": m.itl_window.percentiles(LATENCY_PERCENTILES),
                "window_s": m.itl_window.window_s,
            },
            "blocks": snap.blocks.states,
            "requests": [
                {
                    "id": r.request_id,
                    "status": r.status,
                    "prompt": r.num_prompt_tokens,
                    "output": r.num_output_tokens,
                    "computed": r.num_computed_tokens,
                    "cached": r.num_cached_tokens,
                    "blocks": block_ranges(snap.blocks.owners.get(r.request_id, [])),
                }
                for r in snap.requests
            ],
            "held": {
                tid: block_ranges(ids)
                for tid, ids in snap.blocks.owners.items()
                if tid not in {r.request_id for r in snap.requests}
            },
            "steps": [
                {
                    "i": s.index,
                    "t": s.time,
                    "decode": s.tokens.num_decode,
                    "prefill": s.tokens.num_prefill,
                    "draft": s.tokens.num_draft,
                    "running": s.num_running,
                    "waiting": s.num_waiting,
                    "preempted": s.num_preempted,
                    "ms": round(s.forward_ms, 3),
                }
                for s in snap.steps
            ],
            "budget": {"max_num_batched_tokens": snap.max_num_batched_tokens, "max_num_seqs": snap.max_num_seqs},
            "spec": None
            if not spec
            else {
                "gamma": spec.get("gamma"),
                "mean_acceptance_length": spec.get("mean_acceptance_length"),
                "mean_draft_size": spec.get("mean_draft_size"),
                "num_drafts": num_drafts,
                "num_draft_tokens": spec.get("num_draft_tokens"),
                "num_accepted_tokens": spec.get("num_accepted_tokens"),
                "acceptance_rate": (
                    spec.get("num_accepted_tokens", 0.0) / spec["num_draft_tokens"]
                    if spec.get("num_draft_tokens")
                    else None
                ),
                "acceptance_per_pos": [v / num_drafts if num_drafts else 0.0 for _, v in per_pos],
            },
        }
