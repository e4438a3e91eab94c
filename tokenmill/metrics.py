"""Prometheus metrics with vLLM's names under a `tokenmill:` prefix, and the periodic log line.

Two sources feed them:
  * EngineStats snapshots, taken by the engine thread after every step: gauges (running,
    waiting, KV usage) and cumulative counters (prefix cache, preemptions, tokens). A custom
    collector reads the newest snapshot at scrape time, so the counters equal the core's own.
  * Per-request latencies, observed on the event loop as outputs arrive (histograms).

Adding a counter (for example speculative decoding's): give EngineStats the cumulative field
and add one row to ENGINE_COUNTERS. Rows whose field a core does not report are skipped, so the
speculative-decoding rows below appear as soon as EngineStats.spec_decode carries their keys.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tokenmill.engine.stats import EngineStats
    from tokenmill.outputs import RequestMetrics

logger = logging.getLogger("tokenmill.metrics")


@dataclass(frozen=True)
class StatRow:
    field: str
    """EngineStats attribute; "a.b" reads key b of the dict attribute a."""
    name: str
    """Prometheus name; counters get `_total` appended by the client library."""
    documentation: str


ENGINE_GAUGES: tuple[StatRow, ...] = (
    StatRow("num_running", "tokenmill:num_requests_running", "Number of requests in the running batch."),
    StatRow("num_waiting", "tokenmill:num_requests_waiting", "Number of requests waiting to be scheduled."),
    StatRow("kv_cache_usage", "tokenmill:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent."),
    StatRow("num_blocks_total", "tokenmill:kv_cache_num_blocks", "Number of KV-cache blocks in the pool."),
    StatRow("num_blocks_free", "tokenmill:kv_cache_num_free_blocks", "Number of free KV-cache blocks."),
    StatRow(
        "spec_decode.mean_acceptance_length",
        "tokenmill:spec_decode_mean_acceptance_length",
        "Mean tokens emitted per verified draft: 1 + accepted / drafts.",
    ),
    StatRow(
        "spec_decode.mean_draft_size",
        "tokenmill:spec_decode_mean_draft_size",
        "Mean draft tokens (token-tree nodes) per verified draft.",
    ),
)

LABELED_SPEC_COUNTERS: tuple[tuple[str, str, str, str], ...] = (
    # (key prefix in EngineStats.spec_decode, name, label, documentation): one series per label value
    (
        "num_accepted_tokens_per_pos_",
        "tokenmill:spec_decode_num_accepted_tokens_per_pos",
        "position",
        "Accepted draft tokens at each draft position (a token tree's depth - 1).",
    ),
    (
        "acceptance_length_",
        "tokenmill:spec_decode_acceptance_length",
        "length",
        "Verified drafts by tokens emitted (1 + accepted): the acceptance length distribution.",
    ),
)

ENGINE_COUNTERS: tuple[StatRow, ...] = (
    StatRow(
        "prefix_cache_queries",
        "tokenmill:prefix_cache_queries",
        "Prefix-cache queries, in tokens (prompt tokens looked up).",
    ),
    StatRow("prefix_cache_hits", "tokenmill:prefix_cache_hits", "Prefix-cache hits, in tokens."),
    StatRow("num_preemptions", "tokenmill:num_preemptions", "Cumulative number of preemptions."),
    StatRow(
        "num_blocks_slid_out",
        "tokenmill:kv_cache_blocks_slid_out",
        "KV blocks sliding-window layers returned to the pool (no later query could see them).",
    ),
    StatRow("num_prompt_tokens", "tokenmill:prompt_tokens", "Number of prefill tokens processed."),
    StatRow("num_generation_tokens", "tokenmill:generation_tokens", "Number of generation tokens processed."),
    StatRow("num_steps", "tokenmill:engine_steps", "Engine steps that ran the model."),
    StatRow(
        "step_seconds",
        "tokenmill:engine_step_seconds",
        "Wall seconds inside engine steps (scheduling, forward, sampling, detokenizing, outputs).",
    ),
    StatRow(
        "forward_seconds",
        "tokenmill:engine_forward_seconds",
        "Of the step seconds, the model runner's part (inputs, forward, LM head, sampling).",
    ),
    # Speculative decoding (vLLM's names); emitted once EngineStats carries these fields.
    StatRow("spec_decode.num_drafts", "tokenmill:spec_decode_num_drafts", "Number of spec-decode drafts."),
    StatRow("spec_decode.num_draft_tokens", "tokenmill:spec_decode_num_draft_tokens", "Number of draft tokens."),
    StatRow(
        "spec_decode.num_accepted_tokens",
        "tokenmill:spec_decode_num_accepted_tokens",
        "Number of accepted draft tokens.",
    ),
    # Disaggregation (distributed/kv_connector.ConnectorStats); emitted on prefill and decode workers.
    StatRow("kv_transfer.num_loads", "tokenmill:kv_transfer_loads", "KV pulls started (decode side)."),
    StatRow(
        "kv_transfer.num_loads_failed",
        "tokenmill:kv_transfer_loads_failed",
        "KV pulls that failed; the request recomputed its prompt locally.",
    ),
    StatRow("kv_transfer.num_blocks_loaded", "tokenmill:kv_transfer_blocks_loaded", "KV blocks pulled in."),
    StatRow(
        "kv_transfer.num_blocks_skipped",
        "tokenmill:kv_transfer_blocks_skipped",
        "Prompt blocks not pulled because the local prefix cache held them.",
    ),
    StatRow("kv_transfer.bytes_loaded", "tokenmill:kv_transfer_bytes_loaded", "Bytes of K/V pulled in."),
    StatRow(
        "kv_transfer.load_seconds",
        "tokenmill:kv_transfer_load_seconds",
        "Seconds from pull to blocks in place, summed over pulls.",
    ),
    StatRow("kv_transfer.num_holds", "tokenmill:kv_transfer_holds", "Prompts whose K/V were held for a decode worker."),
    StatRow(
        "kv_transfer.num_holds_expired",
        "tokenmill:kv_transfer_holds_expired",
        "Held K/V nobody pulled in time (blocks returned to the pool).",
    ),
    StatRow("kv_transfer.num_sends", "tokenmill:kv_transfer_sends", "Transfers sent (prefill side)."),
    StatRow("kv_transfer.num_blocks_sent", "tokenmill:kv_transfer_blocks_sent", "KV blocks sent."),
    StatRow("kv_transfer.bytes_sent", "tokenmill:kv_transfer_bytes_sent", "Bytes of K/V sent."),
    StatRow(
        "kv_transfer.send_seconds",
        "tokenmill:kv_transfer_send_seconds",
        "Seconds spent sending, summed over transfers.",
    ),
)

# vLLM's buckets.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def stat_value(stats: EngineStats, field: str) -> float | None:
    """stats.field, or stats.a[b] for "a.b" (a dict of counters: None while the core reports no such key)."""
    head, _, key = field.partition(".")
    value = getattr(stats, head)  # NOTE: a row's field by name; test_metrics checks every row names a field
    if key:
        value = value.get(key)
    return None if value is None else float(value)


class _EngineStatsCollector(Collector):
    def __init__(self, get_stats: Callable[[], EngineStats | None], model_name: str) -> None:
        self._get_stats = get_stats
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        stats = self._get_stats()
        if stats is None:  # still loading
            return
        for row in ENGINE_GAUGES:
            value = stat_value(stats, row.field)
            if value is not None:
                g = GaugeMetricFamily(row.name, row.documentation, labels=["model_name"])
                g.add_metric([self._model_name], value)
                yield g
        for row in ENGINE_COUNTERS:
            value = stat_value(stats, row.field)
            if value is not None:
                c = CounterMetricFamily(row.name, row.documentation, labels=["model_name"])
                c.add_metric([self._model_name], value)
                yield c
        spec = stats.spec_decode
        for prefix, name, label, doc in LABELED_SPEC_COUNTERS:  # e.g. vLLM's per-position acceptance counter
            series = sorted((int(k[len(prefix) :]), v) for k, v in spec.items() if k.startswith(prefix))
            if series:
                c = CounterMetricFamily(name, doc, labels=["model_name", label])
                for key, v in series:
                    c.add_metric([self._model_name, str(key)], float(v))
                yield c

    def describe(self) -> Iterable[Metric]:
        return []  # NOTE: names depend on the core's stats; skip registry duplicate checks


class LatencyWindow:
    """The latencies observed over the last `window_s` seconds (at most `max_samples`), for percentiles
    a person can watch move (the dashboard); Prometheus histograms keep everything since start."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 50_000) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (monotonic time, seconds)

    def observe(self, seconds: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, seconds))

    def values(self, now: float | None = None) -> list[float]:
        horizon = (time.monotonic() if now is None else now) - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        return [v for _, v in self._samples]

    def percentiles(self, ps: tuple[float, ...], now: float | None = None) -> dict[str, float | int]:
        """{"n": count, "p50": seconds, ...} by the nearest-rank rule; only "n" when the window is empty.
        E.g. values 1..10 s, ps (50, 90): {"n": 10, "p50": 5, "p90": 9}."""
        vals = sorted(self.values(now))
        out: dict[str, float | int] = {"n": len(vals)}
        if vals:
            for p in ps:
                out[f"p{p:g}"] = vals[max(0, math.ceil(p / 100 * len(vals)) - 1)]
        return out


class EngineMetrics:
    """One registry per server (no global state): engine gauges/counters plus latency histograms."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineStatsCollector(get_stats, model_name))
        labels = {"model_name": model_name}

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labelnames=["model_name"], buckets=buckets, registry=self.registry).labels(
                **labels
            )

        self.time_to_first_token = hist(
            "tokenmill:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self.inter_token_latency = hist(
            "tokenmill:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS
        )
        self.e2e_request_latency = hist(
            "tokenmill:e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds.",
            _REQUEST_BUCKETS,
        )
        self.request_queue_time = hist(
            "tokenmill:request_queue_time_seconds",
            "Histogram of time spent waiting before first scheduled, in seconds.",
            _REQUEST_BUCKETS,
        )
        self.request_prefill_time = hist(
            "tokenmill:request_prefill_time_seconds",
            "Histogram of time from first scheduled to first token, in seconds.",
            _REQUEST_BUCKETS,
        )
        self.request_decode_time = hist(
            "tokenmill:request_decode_time_seconds",
            "Histogram of time from first token to last token, in seconds.",
            _REQUEST_BUCKETS,
        )
        self.request_prompt_tokens = hist(
            "tokenmill:request_prompt_tokens", "Number of prompt tokens per finished request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = hist(
            "tokenmill:request_generation_tokens", "Number of generated tokens per finished request.", _TOKEN_BUCKETS
        )
        self._success = Counter(
            "tokenmill:request_success",
            "Count of finished requests by finish reason.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name=model_name, finished_reason=reason)
        self._model_name = model_name
        self.num_finished = 0
        """Requests finished (any reason, aborts included): the dashboard's count, equal to the sum of
        request_success over its reasons."""
        self.ttft_window = LatencyWindow()
        self.itl_window = LatencyWindow()

    def observe_ttft(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)
        self.ttft_window.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)
        self.itl_window.observe(seconds)

    def observe_finished(
        self,
        *,
        e2e: float,
        timings: RequestMetrics | None,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        finish_reasons: list[str],
    ) -> None:
        """timings: the engine's clock for the request (queue, prefill and decode times; None: not reported)."""
        self.e2e_request_latency.observe(e2e)
        for hist, seconds in (
            (self.request_queue_time, timings.queue_time if timings else None),
            (self.request_prefill_time, timings.prefill_time if timings else None),
            (self.request_decode_time, timings.decode_time if timings else None),
        ):
            if seconds is not None:
                hist.observe(seconds)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        for reason in set(finish_reasons):
            self._success.labels(model_name=self._model_name, finished_reason=reason).inc()
            self.num_finished += 1

    def observe_aborted(self) -> None:
        """A request whose client went away (or that was cancelled) before it finished."""
        self.num_finished += 1
        self._success.labels(model_name=self._model_name, finished_reason="abort").inc()


class StatLogger:
    """vLLM-style periodic line: throughput since the last line, running/waiting, KV usage, prefix hits."""

    def __init__(self, get_stats: Callable[[], EngineStats | None], interval_s: float = 10.0) -> None:
        self._get_stats = get_stats
        self.interval_s = interval_s
        self._last: EngineStats | None = None
        self._last_time = time.monotonic()
        self._was_idle = True

    def format_line(self, now: float | None = None) -> str | None:
        """The line for the interval that ends now, or None when the engine stayed idle."""
        now = time.monotonic() if now is None else now
        stats = self._get_stats()
        if stats is None:
            return None
        last, dt = self._last, max(now - self._last_time, 1e-9)
        self._last, self._last_time = stats, now

        prompt_tps = (stats.num_prompt_tokens - (last.num_prompt_tokens if last is not None else 0)) / dt
        gen_tps = (stats.num_generation_tokens - (last.num_generation_tokens if last is not None else 0)) / dt
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        is_idle = prompt_tps == 0 and gen_tps == 0 and not stats.num_running and not stats.num_waiting
        if is_idle and self._was_idle:
            return None
        self._was_idle = is_idle
        hit_rate = 100.0 * hits / queries if queries else 0.0
        return (
            f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} "
            f"tokens/s, Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"
        )

    def log(self) -> None:
        line = self.format_line()
        if line is not None:
            logger.info(line)
