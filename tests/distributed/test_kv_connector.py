"""The KV connector's scheduler half, torch-free: which blocks a decode worker pulls (exact block ids), holds and
their expiry, and the scheduler's WAITING_FOR_REMOTE_KV state."""

from __future__ import annotations

import time

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.step_io import SamplerResult, StepOutput
from tokenmill.distributed.kv_connector import (
    ConnectorEvents,
    HoldForDecode,
    KVConnectorScheduler,
    LoadPlan,
    PullFromPrefill,
)
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


def sched(num_blocks=16, role="both", hold=60.0):
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
        CacheConfig(block_size=4),
        num_blocks,
        128,
        KVConnectorScheduler(role, hold),
    )


def req(rid, n, kvt=None, max_tokens=4):
    return Request(
        rid,
        list(range(10, 10 + n)),
        SamplingParams(temperature=0, max_tokens=max_tokens),
        None,
        max_tokens,
        kv_transfer=kvt,
    )


def test_plan_load_examples():
    c = KVConnectorScheduler("decode", 1.0)
    src = PullFromPrefill("h", 1, "t", 11)
    assert c.plan_load(src, 11, 4, 4) == LoadPlan(1, 2)  # tokens 4..9: blocks 1, 2
    assert c.plan_load(PullFromPrefill("h", 1, "t", 9), 9, 8, 4) == LoadPlan(2, 0)


def test_decode_side_admission_pulls_the_uncached_blocks_then_runs():
    s = sched()
    r = req("a", 11, PullFromPrefill("h", 1, "t", 11))
    s.add_request(r)
    out = s.schedule()
    assert out.scheduled == [] and r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    (load,) = out.kv.loads
    assert (load.first_block, load.block_ids) == (0, s.kv.get_block_ids("a")[:3]) == (0, [0, 1, 2])
    assert s.kv.get_block_ids("a") == [0, 1, 2]  # the whole prompt's blocks
    assert not s.kv.pool.get_cached_block(s.kv.block_hashes(r)[0])  # not in the prefix cache before the K/V arrive
    s.apply_kv_events(ConnectorEvents(loads_done={"a": True}))
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 10
    out = s.schedule()
    assert [(x.request_id, x.start_pos, x.num_new_tokens) for x in out.scheduled] == [("a", 10, 1)]
    s.check_integrity()


def test_failed_pull_recomputes_from_the_local_hit():
    s = sched()
    r = req("a", 11, PullFromPrefill("h", 1, "t", 11))
    s.add_request(r)
    s.schedule()
    s.apply_kv_events(ConnectorEvents(loads_done={"a": False}))
    out = s.schedule()
    assert [(x.start_pos, x.num_new_tokens) for x in out.scheduled] == [(0, 11)]
    assert s.connector.stats.num_loads_failed == 1


def test_prefill_side_holds_then_releases_or_expires():
    s = sched(hold=0.05)
    r = req("p", 9, HoldForDecode(), max_tokens=1)
    s.add_request(r)
    out = s.schedule()
    s.update(out, StepOutput({"p": SamplerResult([5])}))
    assert r.is_finished and s.kv.held == {"p": s.kv.held["p"]} and len(s.kv.held["p"]) == 3
    assert s.connector.has_pending_work
    s.check_integrity()
    time.sleep(0.06)
    out = s.schedule()
    assert out.kv.releases == ["p"] and s.kv.held == {} and s.connector.stats.num_holds_expired == 1
    assert s.kv.pool.num_free_blocks == 16
    s.check_integrity()
