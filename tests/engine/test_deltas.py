"""output_kind "delta" (what the server streams) against "cumulative": the joined deltas are the
cumulative output, for stop strings (held back while streaming), n > 1 and logprobs; "final" emits once."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.outputs import RequestOutput


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)


def outputs(llm: LLM, params: SamplingParams, prompt: list[int]) -> list[RequestOutput]:
    engine = llm.engine
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == "r")
    return outs


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=0.0), dict(temperature=0.9, seed=3, n=2, logprobs=2), dict(temperature=0.0, stop=["ab", "e f"])],
)
def test_joined_deltas_equal_the_cumulative_output(llm, kw):
    prompt = [5, 9, 200, 31, 7]
    cumulative = outputs(llm, SamplingParams(max_tokens=24, **kw), prompt)[-1]
    deltas = outputs(llm, SamplingParams(max_tokens=24, output_kind="delta", **kw), prompt)
    assert all(d.is_delta for d in deltas) and deltas[-1].finished and len(deltas) > 3
    joined = deltas[0]
    for d in deltas[1:]:
        joined = joined.merged(d)
    assert len(joined.outputs) == len(cumulative.outputs)
    for a, b in zip(joined.outputs, cumulative.outputs):
        assert (a.index, a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
            b.index,
            b.text,
            b.token_ids,
            b.finish_reason,
            b.stop_reason,
        )
        assert a.num_tokens == len(b.token_ids)
        if kw.get("logprobs"):
            assert [list(x) for x in a.logprobs] == [list(x) for x in b.logprobs]
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob)
    for d in deltas:  # no delta repeats a token: the token counts add up
        assert all(len(c.token_ids) <= c.num_tokens for c in d.outputs)


def test_final_kind_emits_once(llm):
    outs = outputs(llm, SamplingParams(max_tokens=12, temperature=0.0, output_kind="final"), [1, 2, 3])
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 12
