"""The one scheduling rule (core/scheduler.py, DESIGN.md): token budget and sequence cap, running
requests first and oldest first, chunked prefill, prefix hits, preemption of the newest running
request, and draft tokens cut to the budget. Exact tokens, block ids, orders and preempted ids."""

from __future__ import annotations

from dataclasses import replace

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.scheduler import Scheduler, SchedulerOutput, TokenSplit
from tokenmill.core.step_io import BlockCopy, SamplerResult, StepOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks: int = 16, max_num_seqs: int = 8, budget: int = 64, chunked: bool = True) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked),
        CacheConfig(block_size=BS),
        num_blocks,
        max_model_len=256,
    )


def make_request(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), eos_token_id=None, max_tokens=max_tokens)


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """schedule() + update() with `token` sampled for every request that reached its last token."""
    out = sched.schedule()
    sched.update(out, StepOutput({s.request_id: SamplerResult([token]) for s in out.scheduled if s.is_sampling}))
    sched.check_integrity()
    return out


def summary(out: SchedulerOutput) -> list[tuple[str, int, int, list[int]]]:
    """(request id, num_new_tokens, start_pos, block_ids) per scheduled request, in order."""
    return [(s.request_id, s.num_new_tokens, s.start_pos, s.block_ids) for s in out.scheduled]


def test_budget_left_by_running_decodes_goes_to_a_waiting_prompt_chunk():
    """Budget 10: a running decode takes 1, a waiting 20-token prompt is chunked 9, 9, then 2."""
    sched = make_scheduler(budget=10)
    sched.add_request(make_request("a", [100, 101, 102]))
    assert summary(step(sched)) == [("a", 3, 0, [0])]
    sched.add_request(make_request("b", list(range(20))))
    out = step(sched)
    assert summary(out) == [("a", 1, 3, [0]), ("b", 9, 0, [1, 2, 3])]
    assert out.num_tokens == 10
    assert out.token_split() == TokenSplit(num_decode=1, num_prefill=9, num_draft=0)
    assert summary(step(sched)) == [("a", 1, 4, [0, 4]), ("b", 9, 9, [1, 2, 3, 5, 6])]
    out = step(sched)
    assert summary(out) == [("a", 1, 5, [0, 4]), ("b", 2, 18, [1, 2, 3, 5, 6])]
    assert out.token_split() == TokenSplit(num_decode=1, num_prefill=2, num_draft=0)  # b's last chunk
    b = sched.requests["b"]  # the last chunk reached b's last token: it was sampled
    assert (b.num_computed_tokens, b.output_token_ids) == (20, [7])
    assert out.num_tokens == 3 and not sched.waiting


def test_running_requests_go_before_waiting_ones_even_mid_prefill():
    """A running request still mid-prefill is scheduled (in admission order) before a waiting one."""
    sched = make_scheduler(budget=6)
    sched.add_request(make_request("a", [100, 101, 102, 103]))
    sched.add_request(make_request("b", [200, 201, 202, 203]))
    assert summary(step(sched)) == [("a", 4, 0, [0]), ("b", 2, 0, [1])]
    sched.add_request(make_request("c", [300, 301, 302, 303]))
    assert summary(step(sched)) == [("a", 1, 4, [0, 2]), ("b", 2, 2, [1]), ("c", 3, 0, [3])]
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]


def test_budget_exhausted_by_running_serves_the_oldest_first():
    """When running decodes alone exceed the budget, the oldest get it; newer and waiting ones wait."""
    sched = make_scheduler(budget=3)
    for rid, tok in (("a", 100), ("b", 200), ("c", 300)):
        sched.add_request(make_request(rid, [tok]))
    assert summary(step(sched)) == [("a", 1, 0, [0]), ("b", 1, 0, [1]), ("c", 1, 0, [2])]
    sched.add_request(make_request("d", [400]))
    sched.config = replace(sched.config, max_num_batched_tokens=2)
    out = step(sched)
    assert summary(out) == [("a", 1, 1, [0]), ("b", 1, 1, [1])]
    assert not out.preempted_ids
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]
    assert [r.request_id for r in sched.waiting] == ["d"]
    assert sched.requests["c"].num_computed_tokens == 1 and sched.requests["c"].num_tokens == 2


def test_block_shortage_preempts_newest_running_and_admits_nobody():
    """No free block for b: newest c is preempted, b gets c's freed block, d is not admitted this step."""
    sched = make_scheduler(num_blocks=5)
    sched.add_request(make_request("a", [10, 11, 12, 13]))
    sched.add_request(make_request("b", [20, 21, 22, 23]))
    sched.add_request(make_request("c", list(range(30, 38))))
    assert summary(step(sched)) == [("a", 4, 0, [0]), ("b", 4, 0, [1]), ("c", 8, 0, [2, 3])]
    sched.add_request(make_request("d", [40]))
    out = step(sched)
    # a takes the last free block 4; b finds none, c is freed tail first (3, then 2) and b gets 3.
    assert summary(out) == [("a", 1, 4, [0, 4]), ("b", 1, 4, [1, 3])]
    assert out.preempted_ids == ["c"]
    assert sched.kv.pool.num_free_blocks == 1  # block 2 is free, budget is left, yet d waits
    c = sched.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.output_token_ids == [7] and sched.kv.get_block_ids("c") == []
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    # Once a leaves, c is readmitted ahead of d; its first block is still a prefix hit.
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out = step(sched)
    assert summary(out) == [("b", 1, 5, [1, 3]), ("c", 5, 4, [2, 4, 0])]
    assert not out.preempted_ids and [r.request_id for r in sched.waiting] == ["d"]


def test_running_request_preempts_itself_when_it_is_the_newest():
    """The newest running request that cannot get a block preempts itself; older ones are untouched."""
    sched = make_scheduler(num_blocks=3)
    sched.add_request(make_request("a", [10, 11, 12]))
    sched.add_request(make_request("b", [20, 21, 22]))
    sched.add_request(make_request("c", [30, 31, 32, 33]))
    assert summary(step(sched)) == [("a", 3, 0, [0]), ("b", 3, 0, [1]), ("c", 4, 0, [2])]
    out = step(sched)  # a and b decode in place; c needs a 2nd block: none free
    assert summary(out) == [("a", 1, 3, [0]), ("b", 1, 3, [1])]
    assert out.preempted_ids == ["c"] and [r.request_id for r in sched.waiting] == ["c"]
    assert sched.kv.pool.num_free_blocks == 1 and sched.requests["c"].num_computed_tokens == 0


def test_draft_tokens_are_cut_to_the_remaining_budget():
    """A decode with k drafts costs 1 + k; drafts past the budget left by older requests are dropped."""
    sched = make_scheduler(budget=5)
    a = make_request("a", [100, 101])
    b = make_request("b", [200, 201])
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a and b: 2 prompt tokens + 1 sampled (7)
    a.spec_token_ids = [110, 111]
    b.spec_token_ids = [210, 211, 212]
    out = sched.schedule()
    assert summary(out) == [("a", 3, 2, [0, 2]), ("b", 2, 2, [1])]
    assert [s.num_spec_tokens for s in out.scheduled] == [2, 1]
    assert out.token_split() == TokenSplit(num_decode=2, num_prefill=0, num_draft=3)
    assert [s.token_ids for s in out.scheduled] == [[7, 110, 111], [7, 210]]
    assert b.spec_token_ids == [210] and [s.is_sampling for s in out.scheduled] == [True, True]
    # a accepts 1 of 2 drafts (+1 bonus); b rejects its draft: rejected slots are rolled back
    sched.update(out, StepOutput({"a": SamplerResult([110, 8]), "b": SamplerResult([9])}))
    assert (a.num_computed_tokens, a.num_tokens, a.spec_token_ids) == (4, 5, [])
    assert (b.num_computed_tokens, b.num_tokens, b.spec_token_ids) == (3, 4, [])


def test_drafts_dropped_entirely_when_only_the_decode_token_fits():
    """With budget for exactly one token, a request's drafts are all dropped: 1 token, 0 spec."""
    sched = make_scheduler(budget=3)
    a = make_request("a", [100])
    b = make_request("b", [200, 201])
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    a.spec_token_ids = [110]
    b.spec_token_ids = [210, 211]
    out = sched.schedule()
    assert summary(out) == [("a", 2, 1, [0]), ("b", 1, 2, [1])]
    assert [s.num_spec_tokens for s in out.scheduled] == [1, 0]
    assert b.spec_token_ids == [] and out.num_tokens == 3


def test_without_chunked_prefill_a_prompt_waits_for_room_and_blocks_the_queue():
    """Chunking off: a prompt larger than the remaining budget is not started and nothing behind it is."""
    sched = make_scheduler(budget=10, chunked=False)
    sched.add_request(make_request("a", [100, 101, 102], max_tokens=2))
    assert summary(step(sched)) == [("a", 3, 0, [0])]
    sched.add_request(make_request("b", list(range(10))))
    sched.add_request(make_request("c", [300, 301, 302]))  # would fit the 9 left, but queues behind b
    out = step(sched)
    assert summary(out) == [("a", 1, 3, [0])]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert sched.kv.get_block_ids("b") == [] and sched.requests["b"].num_computed_tokens == 0
    assert sched.requests.get("a") is None  # a reached max_tokens and freed block 0
    assert summary(step(sched)) == [("b", 10, 0, [1, 2, 3])]  # the whole prompt at once; c still waits
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert summary(step(sched)) == [("b", 1, 10, [1, 2, 3]), ("c", 3, 0, [4])]


def test_prefix_hit_costs_only_the_uncached_tokens():
    """A waiting prompt with cached leading blocks (and a cached tail) starts after them and spends budget on the
    rest only."""
    sched = make_scheduler(budget=10, chunked=False)
    sched.add_request(make_request("a", list(range(10))))
    assert summary(step(sched)) == [("a", 10, 0, [0, 1, 2])]
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)  # frees 2, 1, 0; 0, 1 and the tail 2 stay cached
    sched.config = replace(sched.config, max_num_batched_tokens=3)
    b = make_request("b", list(range(10)))
    sched.add_request(b)
    out = step(sched)
    assert summary(out) == [("b", 1, 9, [0, 1, 3])] and out.block_copies == [BlockCopy(2, 3)]
    assert (b.num_cached_tokens, b.num_computed_tokens, b.output_token_ids) == (9, 10, [7])


def test_max_num_seqs_caps_admission_until_a_request_leaves():
    """At most max_num_seqs requests run; the next waiting one is admitted when one finishes."""
    sched = make_scheduler(max_num_seqs=2)
    for rid, base in (("a", 10), ("b", 20), ("c", 30)):
        sched.add_request(make_request(rid, [base, base + 1, base + 2]))
    assert summary(step(sched)) == [("a", 3, 0, [0]), ("b", 3, 0, [1])]
    assert summary(step(sched)) == [("a", 1, 3, [0]), ("b", 1, 3, [1])]
    assert [r.request_id for r in sched.waiting] == ["c"]
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out = step(sched)
    assert summary(out) == [("b", 1, 4, [1, 2]), ("c", 3, 0, [3])]
    assert out.finished_ids == ["a"] and not sched.waiting
