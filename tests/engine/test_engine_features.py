"""Engine-level sampling features on a tiny random model: seeds, n, stops, min_tokens, logprobs."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), max_model_len=256, num_gpu_blocks_override=128, max_num_batched_tokens=64)


def texts(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_request_independent_of_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = llm.generate(["Tell me a story"], p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20)
    batch = llm.generate(
        ["a", "Tell me a story", "something much longer than the rest of them"], [others, p, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(["Tell me a story"], p, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    llm.check_integrity()


def test_parameters_that_make_every_probability_nan_still_sample_token_ids(llm):
    """repetition_penalty 5e-324 (schemathesis found it) turns the logits into inf and the probabilities into NaN:
    the sampler gives a token id (the row's argmax), not the vocabulary size, and the engine goes on serving."""
    vocab = llm.engine.model.config.vocab_size
    p = SamplingParams(temperature=1.0, repetition_penalty=5e-324, seed=1, max_tokens=6, ignore_eos=True)
    out = llm.generate(["Hello there"], p, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 6 and all(0 <= t < vocab for t in out)
    assert len(llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    llm.check_integrity()


def test_unseeded_samples_differ(llm):
    outs = llm.generate(["Hello"] * 4, SamplingParams(temperature=1.0, max_tokens=12), use_tqdm=False)
    assert len({tuple(t) for t in texts(outs)}) > 1


def test_n_samples_equal_separately_seeded_requests(llm):
    out = llm.generate(["Once upon"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        ref = llm.generate(["Once upon"], SamplingParams(temperature=1.0, seed=7 + i, max_tokens=10), use_tqdm=False)
        assert c.token_ids == ref[0].outputs[0].token_ids
    llm.check_integrity()


def test_max_tokens_and_ignore_eos(llm):
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"


def test_stop_token_ids(llm):
    ref = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    toks = ref.outputs[0].token_ids
    stop_tok = toks[5]
    first = toks.index(stop_tok)
    out = llm.generate(
        ["The"],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == toks[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_min_tokens_suppresses_stop_tokens(llm):
    ref = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    stop_tok = ref.outputs[0].token_ids[0]
    out = llm.generate(
        ["The"],
        SamplingParams(temperature=0, max_tokens=12, min_tokens=4, ignore_eos=True, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= 4 and stop_tok not in out.token_ids[:4]


def test_stop_string(llm):
    ref = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    text = ref.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    out = llm.generate(
        ["The"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    llm.check_integrity()


def test_logprobs(llm):
    out = llm.generate(
        ["Hi"], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, d in zip(out.token_ids, out.logprobs):
        assert tok in d and d[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(d) <= 4
        assert all(lp.logprob <= 0 for lp in d.values())
    assert out.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(out.token_ids, out.logprobs)))


def test_chat_template(real_model_path):
    # The file's exact weights (dequantized): its first answer token is a near tie ("The" 25.33, "L" 25.24), which
    # int8 activations flip to "L'Étoile, ..." in llama.cpp and in our integer GGUF kernel alike.
    llm = LLM(model=str(real_model_path), kv_cache_memory_bytes=32 << 20, gguf_dequantize=True)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.prompt.startswith("<|im_start|>system")
    llm.check_integrity()
