"""n > 1 in the scheduler: samples fork from the leader in the step that computes its last prompt
token, share its blocks, and copy the partly filled last block on first write."""

from __future__ import annotations

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.kv_cache_manager import BlockCopy
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.step_io import SamplerResult, StepOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks: int = 16, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        CacheConfig(block_size=BS),
        num_blocks,
        max_model_len=256,
    )


def make_request(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), eos_token_id=None, max_tokens=max_tokens)


def fake_results(out, token: int = 7) -> dict[str, SamplerResult]:
    return {s.request_id: SamplerResult([token + i]) for i, s in enumerate(out.scheduled + out.forked) if s.is_sampling}


def test_forks_share_prompt_blocks_then_copy_partial_block():
    sched = make_scheduler()
    leader = make_request("p#0", list(range(6)))
    forks = [make_request(f"p#{i}", list(range(6))) for i in (1, 2)]
    sched.add_request(leader, forks=forks)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["p#0"] and out.scheduled[0].num_new_tokens == 6
    assert [(s.request_id, s.fork_of, s.num_new_tokens, s.block_ids) for s in out.forked] == [
        ("p#1", "p#0", 0, [0, 1]),
        ("p#2", "p#0", 0, [0, 1]),
    ]
    sched.kv.pool.check_integrity({0: 3, 1: 3})
    sched.update(out, StepOutput(fake_results(out)))
    assert [r.output_token_ids for r in [leader, *forks]] == [[7], [8], [9]]
    assert all(r.num_computed_tokens == 6 for r in [leader, *forks])
    # decode: position 6 lies in shared block 1; the first two writers copy it, the last writes in place
    out = sched.schedule()
    assert out.block_copies == [BlockCopy(1, 2), BlockCopy(1, 3)]
    assert [s.block_ids for s in out.scheduled] == [[0, 2], [0, 3], [0, 1]]
    sched.kv.pool.check_integrity({0: 3, 1: 1, 2: 1, 3: 1})
    sched.check_integrity()


def test_fork_waits_for_the_last_prompt_chunk():
    sched = make_scheduler(budget=4)  # prompt of 10 in chunks of 4, 4, 2
    leader = make_request("p#0", list(range(10)))
    sched.add_request(leader, forks=[make_request("p#1", list(range(10)))])
    for expected in (4, 4):
        out = sched.schedule()
        assert out.scheduled[0].num_new_tokens == expected and not out.forked
        sched.update(out, StepOutput({}))
    out = sched.schedule()
    assert [s.request_id for s in out.forked] == ["p#1"] and out.forked[0].block_ids == [0, 1, 2]
    sched.update(out, StepOutput(fake_results(out)))
    sched.check_integrity()


def test_admission_reserves_sequence_slots_for_pending_forks():
    sched = make_scheduler(max_num_seqs=3)
    sched.add_request(make_request("a#0", [1, 2, 3]), forks=[make_request("a#1", [1, 2, 3])])
    sched.add_request(make_request("b#0", [4, 5, 6]), forks=[make_request("b#1", [4, 5, 6])])
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a#0"]  # b's 2 samples would make 4 > 3
    assert len(sched.running) == 2


def test_aborting_a_group_before_the_fork_frees_everything():
    sched = make_scheduler()
    leader = make_request("p#0", list(range(6)))
    fork = make_request("p#1", list(range(6)))
    sched.add_request(leader, forks=[fork])
    sched.finish_request("p#0", RequestStatus.FINISHED_ABORTED)
    sched.finish_request("p#1", RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished() and not sched.pending_forks
    sched.check_integrity()
    assert sched.kv.pool.num_free_blocks == 16


def test_preempted_fork_recomputes_and_keeps_its_tokens():
    sched = make_scheduler(num_blocks=4)
    leader = make_request("p#0", list(range(6)), max_tokens=6)
    fork = make_request("p#1", list(range(6)), max_tokens=6)
    sched.add_request(leader, forks=[fork])
    out = sched.schedule()
    sched.update(out, StepOutput(fake_results(out)))
    num_preempted = 0
    for _ in range(8):
        out = sched.schedule()
        num_preempted += len(out.preempted_ids)
        sched.update(out, StepOutput(fake_results(out)))
        sched.check_integrity()
        if not sched.has_unfinished():
            break
    assert num_preempted >= 1
    assert leader.is_finished and fork.is_finished
    assert leader.num_output_tokens == fork.num_output_tokens == 6
