"""metrics.py without a server: the stats collector, spec-decode rows, and the periodic log line."""

from __future__ import annotations

from dataclasses import fields

from prometheus_client import generate_latest

from tests.server.conftest import engine_stats as Stats
from tokenmill.engine.stats import EngineStats
from tokenmill.metrics import ENGINE_COUNTERS, ENGINE_GAUGES, EngineMetrics, StatLogger
from tokenmill.outputs import RequestMetrics


def test_every_row_reads_a_field_of_engine_stats():
    names = {f.name: f for f in fields(EngineStats)}
    for row in ENGINE_GAUGES + ENGINE_COUNTERS:
        head, _, key = row.field.partition(".")
        assert head in names, row
        assert not key or names[head].type.startswith("dict"), row  # "a.b" reads key b of a dict field


def _scrape(metrics: EngineMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_counters_mirror_engine_stats_and_spec_rows_appear_when_reported():
    holder = {"stats": None}
    metrics = EngineMetrics("m", lambda: holder["stats"])
    assert "tokenmill:num_requests_running" not in _scrape(metrics)  # still loading: no engine stats
    holder["stats"] = Stats(
        num_running=3,
        num_waiting=2,
        kv_cache_usage=0.25,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        num_preemptions=1,
        num_prompt_tokens=500,
        num_generation_tokens=70,
    )
    text = _scrape(metrics)
    for line in [
        'tokenmill:num_requests_running{model_name="m"} 3.0',
        'tokenmill:num_requests_waiting{model_name="m"} 2.0',
        'tokenmill:kv_cache_usage_perc{model_name="m"} 0.25',
        'tokenmill:prefix_cache_queries_total{model_name="m"} 100.0',
        'tokenmill:prefix_cache_hits_total{model_name="m"} 40.0',
        'tokenmill:num_preemptions_total{model_name="m"} 1.0',
        'tokenmill:prompt_tokens_total{model_name="m"} 500.0',
        'tokenmill:generation_tokens_total{model_name="m"} 70.0',
    ]:
        assert line in text, line
    assert "spec_decode" not in text
    holder["stats"] = Stats(
        spec_decode={
            "num_drafts": 5,
            "num_draft_tokens": 20,
            "num_accepted_tokens": 12,
            "mean_acceptance_length": 3.4,
            "num_accepted_tokens_per_pos_0": 5,
            "num_accepted_tokens_per_pos_1": 4,
            "num_accepted_tokens_per_pos_2": 3,
            "mean_draft_size": 4.0,
            "acceptance_length_1": 2,
            "acceptance_length_4": 3,
        }
    )
    text = _scrape(metrics)
    assert 'tokenmill:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0' in text
    assert 'tokenmill:spec_decode_mean_acceptance_length{model_name="m"} 3.4' in text
    for pos, n in ((0, 5), (1, 4), (2, 3)):
        line = f'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{pos}"}} {n}.0'
        assert line in text, line
    assert 'tokenmill:spec_decode_mean_draft_size{model_name="m"} 4.0' in text  # token trees
    for length, n in ((1, 2), (4, 3)):
        line = f'tokenmill:spec_decode_acceptance_length_total{{length="{length}",model_name="m"}} {n}.0'
        assert line in text, line


def test_latency_histograms_and_finish_reasons():
    metrics = EngineMetrics("m", lambda: None)
    metrics.observe_ttft(0.2)
    metrics.observe_itl(0.05)
    timings = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.25, first_token_time=1.75, last_token_time=2.75)
    metrics.observe_finished(
        e2e=2.0, timings=timings, num_prompt_tokens=7, num_generation_tokens=3, finish_reasons=["length", "stop"]
    )
    metrics.observe_finished(
        e2e=0.5,
        timings=RequestMetrics(arrival_time=1.0),
        num_prompt_tokens=7,
        num_generation_tokens=0,
        finish_reasons=["abort"],
    )  # aborted while queued
    metrics.observe_aborted()
    text = _scrape(metrics)
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        assert f'tokenmill:{name}_count{{model_name="m"}} 1.0' in text, name
    assert 'tokenmill:e2e_request_latency_seconds_count{model_name="m"} 2.0' in text
    # the queued-then-aborted request has no queue, prefill or decode time: one sample each, from `timings`
    for name, seconds in (("queue", 0.25), ("prefill", 0.5), ("decode", 1.0)):
        assert f'tokenmill:request_{name}_time_seconds_count{{model_name="m"}} 1.0' in text, name
        assert f'tokenmill:request_{name}_time_seconds_sum{{model_name="m"}} {seconds}' in text, name
    for reason, n in (("length", 1), ("stop", 1), ("abort", 2)):
        assert f'tokenmill:request_success_total{{finished_reason="{reason}",model_name="m"}} {n}.0' in text


def test_stat_line_reports_interval_throughput_and_stays_quiet_when_idle():
    holder = {"stats": Stats()}
    logger = StatLogger(lambda: holder["stats"], interval_s=10)
    assert logger.format_line(now=logger._last_time + 10) is None  # idle from the start: no line
    t = logger._last_time
    holder["stats"] = Stats(
        num_running=2,
        kv_cache_usage=0.5,
        prefix_cache_queries=10,
        prefix_cache_hits=5,
        num_prompt_tokens=100,
        num_generation_tokens=50,
    )
    line = logger.format_line(now=t + 10)
    assert line == (
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 2 reqs, "
        "Waiting: 0 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 50.0%"
    )
    holder["stats"] = Stats(num_prompt_tokens=100, num_generation_tokens=50, prefix_cache_queries=10)
    assert "Running: 0 reqs" in logger.format_line(now=t + 20)  # the first idle interval is logged once
    assert logger.format_line(now=t + 30) is None
