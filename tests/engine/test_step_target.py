"""target_step_ms in the engine: the step-time model is fitted from real steps, a long prompt is cut into small
chunks beside running decodes, and greedy output is unchanged (tiny model, float32)."""

from __future__ import annotations

from tests.distributed.test_disaggregation import prompts
from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore


def run(path, target_ms):
    e = EngineCore(
        EngineConfig.from_kwargs(
            model=str(path), dtype="float32", max_num_batched_tokens=512, target_step_ms=target_ms, min_prefill_chunk=16
        )
    )
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
    # the model was fitted from the engine's own steps: both kinds were seen and a fit came out. Its
    # coefficients are wall-clock figures of a tiny model on a shared host (a prefill token costs about as
    # much as the noise), so their signs are not asserted; test_step_cost.py checks the fit on exact data.
    assert model.cost is not None
    assert len(model.samples) >= model.MIN_SAMPLES and len({p for _, p, _, _ in model.samples}) >= 2
    assert steps_free == 1 and steps_tight >= 300 // 17  # 16 prompt tokens (+1) per step
