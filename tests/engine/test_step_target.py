"""target_step_ms in the engine: the step-time model is fitted from the engine's steps, a long prompt is cut into
small chunks beside running decodes, and greedy output is unchanged (tiny model, float32).

The tiny model's step times are mostly noise (a prefill token costs about as much as the jitter), so a fit of them
can come out with no positive prefill slope, and then nothing is cut: the test failed now and then on that. The
engine's steps therefore report exact synthetic times (`ExactClock`, a stand-in for the clock only): the fit, the
cut and the identity are what is tested; test_step_cost.py checks the fit itself on exact data."""

from __future__ import annotations

from tests.distributed.test_disaggregation import prompts
from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.core.step_cost import StepCostModel
from tokenmill.engine.core import EngineCore

BASE_S, DECODE_S, PREFILL_S = 2e-3, 1e-4, 5e-5


class ExactClock(StepCostModel):
    """Observes t = 2 ms + 0.1 ms per decode token + 0.05 ms per prefill token instead of the measured seconds."""

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, seconds: float, kilo_keys: float = 0.0) -> None:
        exact = BASE_S + DECODE_S * num_decode_tokens + PREFILL_S * num_prefill_tokens
        super().observe(num_decode_tokens, num_prefill_tokens, exact, kilo_keys)


def run(path, target_ms):
    e = EngineCore(
        EngineConfig.from_kwargs(
            model=str(path), dtype="float32", max_num_batched_tokens=512, target_step_ms=target_ms, min_prefill_chunk=16
        )
    )
    e.scheduler.step_cost = ExactClock()
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for i, p in enumerate(prompts(8, seed=11, lo=20, hi=60)):
        e.add_request(f"s{i}", p, params)
    for _ in range(12):  # the streams are decoding and the model has seen prefill and decode steps
        e.step()
    e.add_request("long", prompts(1, seed=12, lo=300, hi=301)[0], params)
    outs, steps_to_first = {}, None
    for n in range(1, 10_000):
        for o in e.step():
            outs[o.request_id] = o
            if o.request_id == "long" and steps_to_first is None:
                steps_to_first = n
        if not e.has_unfinished_requests():
            break
    e.check_integrity()
    return {k: o.outputs[0].token_ids for k, o in outs.items()}, steps_to_first, e.scheduler.step_cost


def test_target_cuts_the_long_prompt_and_keeps_greedy_output(tiny_llama):
    free, steps_free, _ = run(tiny_llama, None)
    tight, steps_tight, model = run(tiny_llama, 0.001)  # below any step: every step gets the minimum chunk
    assert tight == free
    # the model was fitted from the engine's own steps (both kinds seen) and found the prefill slope
    assert model.cost is not None
    assert len(model.samples) >= model.MIN_SAMPLES and len({p for _, p, _, _ in model.samples}) >= 2
    assert abs(model.cost.c - PREFILL_S) < 0.1 * PREFILL_S
    assert steps_free == 1 and steps_tight >= 300 // 17  # 16 prompt tokens (+1) per step
