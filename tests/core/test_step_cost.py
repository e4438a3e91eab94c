"""The step-time model and the chunk sizes it gives the scheduler under target_step_ms (torch-free, exact)."""

from __future__ import annotations

import pytest

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.step_cost import StepCost, StepCostModel
from tokenmill.core.step_io import SamplerResult, StepOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

LAW = StepCost(a=0.008, b=0.001, c=0.0005)  # 8 ms + 1 ms per decode + 0.5 ms per prefill token


def feed(model: StepCostModel, law: StepCost = LAW) -> None:
    for d, p in [(1, 0), (4, 0), (16, 0), (8, 64), (16, 32), (2, 200), (12, 100), (3, 16), (16, 0), (5, 50)]:
        model.observe(d, p, law.predict(d, p))


def test_fit_recovers_an_exact_law_and_the_worked_example():
    m = StepCostModel()
    feed(m)
    c = m.cost
    assert (c.a, c.b, c.c) == pytest.approx((LAW.a, LAW.b, LAW.c), rel=1e-3)  # the ridge on b biases a hair
    assert LAW.prefill_budget(16, 0.040) == 32
    assert LAW.prefill_budget(40, 0.040) == 0


def test_no_fit_before_prefill_steps_were_seen():
    m = StepCostModel()
    for d in range(1, 20):
        m.observe(d, 0, LAW.predict(d, 0))
    assert m.cost is None


def make(target_ms=40.0, min_chunk=16, budget=512):
    s = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=64, target_step_ms=target_ms, min_prefill_chunk=min_chunk
        ),
        CacheConfig(block_size=4),
        512,
        1024,
    )
    feed(s.step_cost)
    return s


def run_decodes(s: Scheduler, n: int) -> None:
    """n requests past their (3-token) prompts, decoding; a tight target admits them over several steps."""
    for i in range(n):
        s.add_request(Request(f"d{i}", [5, 6, 7], SamplingParams(max_tokens=100), None, 100))
    while s.waiting:
        out = s.schedule()
        s.update(out, StepOutput({r.request_id: SamplerResult([9]) for r in out.scheduled if r.is_sampling}))
    assert len(s.running) == n


def test_a_prompt_beside_16_decodes_gets_the_modelled_chunk():
    s = make()
    run_decodes(s, 16)
    s.add_request(Request("long", list(range(10, 210)), SamplingParams(max_tokens=4), None, 4))
    out = s.schedule()
    chunks = {r.request_id: r.num_new_tokens for r in out.scheduled}
    assert chunks["long"] == 33 and sum(chunks.values()) == 16 + 33  # 32 prefill tokens + 1: 40 ms by the model
    s.update(out, StepOutput({}))
    out = s.schedule()  # the rest keeps the same size
    assert {r.request_id: r.num_new_tokens for r in out.scheduled}["long"] == 33


def test_a_busy_step_still_gives_the_prompt_its_minimum():
    s = make(target_ms=5.0, min_chunk=16)  # 16 decodes alone take 24 ms by the model
    run_decodes(s, 16)
    s.add_request(Request("long", list(range(10, 210)), SamplingParams(max_tokens=4), None, 4))
    out = s.schedule()
    assert {r.request_id: r.num_new_tokens for r in out.scheduled}["long"] == 17


def test_without_a_target_the_budget_alone_decides():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=512), CacheConfig(block_size=4), 512, 1024)
    feed(s.step_cost)
    run_decodes(s, 16)
    s.add_request(Request("long", list(range(10, 210)), SamplingParams(max_tokens=4), None, 4))
    assert {r.request_id: r.num_new_tokens for r in s.schedule().scheduled}["long"] == 200


def test_config_errors():
    with pytest.raises(ValueError, match="needs chunked prefill"):
        SchedulerConfig(target_step_ms=30, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="target_step_ms must be > 0"):
        SchedulerConfig(target_step_ms=0)
    with pytest.raises(ValueError, match="step_time_factor must be > 1"):
        SchedulerConfig(step_time_factor=1.0)


def make_relative(factor=2.0, budget=512, fitted=True):
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64, step_time_factor=factor, min_prefill_chunk=16),
        CacheConfig(block_size=4),
        512,
        1024,
    )
    if fitted:
        feed(s.step_cost)
    return s


def test_a_relative_target_follows_the_decode_batch_it_is_heading_to():
    s = make_relative(2.0)
    run_decodes(s, 16)  # 16 decodes + the waiting prompt: 17 x 1 ms + 8 = 25 ms; target 50
    s.add_request(Request("long", list(range(10, 210)), SamplingParams(max_tokens=4), None, 4))
    cost = s.step_cost.cost
    expected = cost.prefill_budget(16, 2.0 * cost.predict(17, 0, 0.016 * 4 + 0.201))
    assert expected in (51, 52)  # (50 - 8 - 16) / 0.5, up to the fit's last digit
    chunks = {r.request_id: r.num_new_tokens for r in s.schedule().scheduled}
    assert chunks["long"] == expected + 1 and sum(chunks.values()) == 16 + expected + 1


def test_waiting_prompts_raise_a_relative_target_up_to_max_num_seqs():
    """4 decodes and 12 prompts queued: the target is twice a 16-decode step (48 ms), not twice a 4-decode one
    (24 ms), so the prompts get (48 - 8 - 4) / 0.5 = 72 tokens, not 24. With max_num_seqs 8 only 4 of the
    queued prompts count: twice an 8-decode step, (32 - 8 - 4) / 0.5 = 40 tokens."""
    for max_seqs, expected in ((64, 72), (8, 40)):
        s = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=512, max_num_seqs=max_seqs, step_time_factor=2.0, min_prefill_chunk=16
            ),
            CacheConfig(block_size=4),
            512,
            1024,
        )
        feed(s.step_cost)
        run_decodes(s, 4)
        for i in range(12):
            s.add_request(Request(f"p{i}", [1, 2, 3, 4] * 25, SamplingParams(max_tokens=4), None, 4))
        cost = s.step_cost.cost
        heading = min(16, max_seqs)
        assert cost.prefill_budget(4, 2.0 * cost.predict(heading, 0, 0)) in (expected - 1, expected)
        out = s.schedule()
        prefill = sum(r.num_new_tokens - 1 for r in out.scheduled if r.request_id.startswith("p"))
        assert prefill in (expected - 1, expected)


def test_a_relative_target_with_nothing_decoding_leaves_the_budget():
    s = make_relative(2.0)
    s.add_request(Request("long", list(range(10, 210)), SamplingParams(max_tokens=4), None, 4))
    assert {r.request_id: r.num_new_tokens for r in s.schedule().scheduled}["long"] == 200


def test_a_relative_target_before_any_fit_gives_the_minimum_beside_decodes():
    s = make_relative(2.0, fitted=False)
    run_decodes(s, 4)
    s.add_request(Request("long", list(range(10, 210)), SamplingParams(max_tokens=4), None, 4))
    assert {r.request_id: r.num_new_tokens for r in s.schedule().scheduled}["long"] == 17


def test_serve_turns_the_relative_target_on_and_generate_does_not():
    import argparse

    from tokenmill.entrypoints.engine_args import add_engine_args
    from tokenmill.entrypoints.openai.cli import SERVE_DEFAULTS

    serve, plain = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_engine_args(serve, defaults=SERVE_DEFAULTS)
    add_engine_args(plain)
    assert serve.parse_args([]).step_time_factor == 2.0
    assert plain.parse_args([]).step_time_factor is None
    args = plain.parse_args(["--target-step-ms", "120", "--max-model-len", "256"])
    assert args.target_step_ms == 120.0 and args.max_model_len == 256


def test_shorter_prompts_take_the_allowance_first_and_the_oldest_keeps_its_minimum():
    """The worked example of Scheduler._prefill_plan: 4 decodes under a 62.1 ms target leave 100 prompt tokens
    ((62.1 - 8 - 4) / 0.5). A (900 tokens left) is promised 16, C (30) and B (40) take 29 + 39, A the 16 left."""
    s = make(target_ms=62.1, min_chunk=16)
    run_decodes(s, 4)
    s.add_request(Request("A", list(range(10, 1011)), SamplingParams(max_tokens=4), None, 4))
    out = s.schedule()
    assert {r.request_id: r.num_new_tokens for r in out.scheduled}["A"] == 101  # alone: the whole allowance
    s.update(out, StepOutput({}))
    s.add_request(Request("B", [3] * 40, SamplingParams(max_tokens=4), None, 4))
    s.add_request(Request("C", [4] * 30, SamplingParams(max_tokens=4), None, 4))
    out = s.schedule()
    chunks = [(r.request_id, r.num_new_tokens) for r in out.scheduled if not r.request_id.startswith("d")]
    assert chunks == [("A", 33), ("C", 30), ("B", 40)]  # C admitted before B, which was queued first
    assert all(r.is_sampling for r in out.scheduled if r.request_id in "BC")
    s.update(out, StepOutput({r.request_id: SamplerResult([9]) for r in out.scheduled if r.is_sampling}))
    out = s.schedule()  # B and C decode now; A has the allowance again
    assert {r.request_id: r.num_new_tokens for r in out.scheduled}["A"] == 1 + s.step_cost.cost.prefill_budget(
        6, 0.0621
    )


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones():
    s = make(target_ms=62.1, min_chunk=16)
    run_decodes(s, 4)
    s.add_request(Request("A", list(range(10, 1011)), SamplingParams(max_tokens=4), None, 4))
    done_at = None
    for step in range(200):
        s.add_request(Request(f"s{step}", [5] * 120, SamplingParams(max_tokens=1), None, 1))  # more than fits
        out = s.schedule()
        a = s.requests["A"]
        s.update(out, StepOutput({r.request_id: SamplerResult([9]) for r in out.scheduled if r.is_sampling}))
        for r in [r for r in s.running if r.request_id.startswith("s") and r.num_output_tokens]:
            s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
        if a.num_output_tokens:
            done_at = step
            break
    assert done_at is not None and done_at <= 1000 // 16 + 1  # at least 16 tokens a step


LAW_E = StepCost(a=0.008, b=0.001, c=0.0005, e=0.001)  # + 1 ms per thousand keys read


def test_each_prompt_chunk_is_priced_from_where_its_prompt_stands():
    """A long prompt A is the oldest (promised 16 tokens a step); B, shorter, takes the rest of the allowance
    and moves far ahead of A. Sized at A's position, B's late chunks (each token reading ~800 keys) ran steps
    to 79 ms by the model against the 62.1 ms target; priced at B's own position, every step stays within it."""
    from tokenmill.core.step_cost import chunk_kilo_keys

    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, target_step_ms=62.1, min_prefill_chunk=16),
        CacheConfig(block_size=4),
        4096,
        8192,
    )
    for d, p, k in [
        (1, 0, 0.1),
        (4, 0, 2.0),
        (16, 0, 8.0),
        (8, 64, 30.0),
        (16, 32, 5.0),
        (2, 200, 60.0),
        (12, 100, 90.0),
        (3, 16, 1.0),
        (16, 0, 20.0),
        (5, 50, 45.0),
    ]:
        s.step_cost.observe(d, p, LAW_E.predict(d, p, k), k)
    assert (s.step_cost.cost.c, s.step_cost.cost.e) == pytest.approx((LAW_E.c, LAW_E.e), rel=1e-2)
    run_decodes(s, 4)
    s.add_request(Request("A", list(range(10, 2011)), SamplingParams(max_tokens=4), None, 4))
    s.update(s.schedule(), StepOutput())  # A alone: it starts
    s.add_request(Request("B", [7] * 900, SamplingParams(max_tokens=4), None, 4))
    b_chunks = []
    while s.requests["B"].num_output_tokens == 0:
        out = s.schedule()
        decodes = [r for r in out.scheduled if r.request_id.startswith("d")]
        prompts = {r.request_id: r for r in out.scheduled if not r.request_id.startswith("d")}
        keys = sum(chunk_kilo_keys(r.start_pos, r.num_new_tokens) for r in out.scheduled)
        prefill = sum(r.num_new_tokens - 1 for r in prompts.values())
        assert LAW_E.predict(len(decodes) + len(prompts), prefill, keys) <= 0.0621 * 1.02  # the fit's rounding
        assert prompts["A"].num_new_tokens >= 16  # the oldest keeps its minimum
        if "B" in prompts:
            b_chunks.append((prompts["B"].start_pos, prompts["B"].num_new_tokens))
        s.update(out, StepOutput({r.request_id: SamplerResult([9]) for r in out.scheduled if r.is_sampling}))
    first, late = b_chunks[0], b_chunks[-2]
    assert late[0] > 600 and late[1] < first[1] / 2  # late chunks are smaller: each token reads more keys
