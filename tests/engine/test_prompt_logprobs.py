"""Prompt logprobs (SamplingParams.prompt_logprobs) against a dense Hugging Face forward of the tiny float32 model:
whole prompts, chunked prefill, a prefix-cache-warm engine, max_tokens 0, n > 1, speculative decoding; the C++
layer loop keeps serving the steps; logits are computed a bounded slice at a time."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.core.step_io import StepInput
from tokenmill.request import Request
from tokenmill.worker import prompt_outputs

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because it was late for dinner",
    "Hello",
    "In 1905 Einstein published four papers that changed physics: on the photoelectric effect, Brownian motion,",
]


def dense_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is log p(next token | ids[: i + 1]), the oracle."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_matches_dense(hf, ids: list[int], got: list, num_top: int) -> None:
    """got: RequestOutput.prompt_logprobs; every entry's values equal the dense oracle's, the prompt's own token is
    among them, and the top num_top values are the oracle's top values (ties may swap which tokens)."""
    ref = dense_logprobs(hf, ids)
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry, row = got[i], ref[i - 1]
        assert ids[i] in entry
        for tok, lp in entry.items():
            assert lp.logprob == pytest.approx(row[tok].item(), abs=1e-4), (i, tok)
            assert lp.decoded_token is not None
        own = entry[ids[i]]
        assert abs(own.rank - ((row > row[ids[i]]).sum().item() + 1)) <= 1  # a near-tie may move it by one
        top = sorted((lp.logprob for t, lp in entry.items() if lp.rank <= num_top), reverse=True)[:num_top]
        assert top == pytest.approx(row.topk(num_top).values.tolist(), abs=1e-4)


def prompt_logprobs_of(llm: LLM, params: SamplingParams) -> list:
    return llm.generate(PROMPTS, params, use_tqdm=False)


def test_prompt_logprobs_equal_dense_forward_whole_and_chunked(tiny_llama, hf):
    """One engine with room for whole prompts, one that cuts them into 7-token chunks: both equal the oracle."""
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3, ignore_eos=True)
    results = []
    for budget in (512, 7):
        llm = LLM(model=str(tiny_llama), max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=budget)
        outs = prompt_logprobs_of(llm, params)
        for out in outs:
            assert_matches_dense(hf, out.prompt_token_ids, out.prompt_logprobs, 3)
            assert len(out.outputs[0].token_ids) == 4
        loop = llm.engine.executor.runner.decode_loop
        assert loop is not None and loop.steps_served > 0  # the C++ layer loop served these steps
        llm.check_integrity()
        results.append(outs)
    whole, chunked = results
    for a, b in zip(whole, chunked):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert ea.keys() == eb.keys()


def test_prefix_cache_hit_does_not_drop_positions(tiny_llama, hf):
    """A prompt the prefix cache holds is recomputed whole when it asks for prompt logprobs (no hit), and its
    blocks still serve the next request that does not ask."""
    llm = LLM(model=str(tiny_llama), max_model_len=256, num_gpu_blocks_override=64, block_size=4)
    prompt = PROMPTS[2]
    warm = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    hits = llm.stats().prefix_cache_hits
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and llm.stats().prefix_cache_hits == hits
    assert_matches_dense(hf, out.prompt_token_ids, out.prompt_logprobs, 2)
    assert out.outputs[0].token_ids == warm.outputs[0].token_ids
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None
    llm.check_integrity()


def test_max_tokens_zero_scores_the_prompt_only(tiny_llama, hf):
    """lm-evaluation-harness's loglikelihood request: the prompt's logprobs and nothing generated; n > 1 too."""
    llm = LLM(model=str(tiny_llama), max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.token_ids == [] and c.text == "" and c.finish_reason == "length"
        assert_matches_dense(hf, out.prompt_token_ids, out.prompt_logprobs, 0)
    two = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=0, prompt_logprobs=1, n=2), use_tqdm=False)[0]
    assert [c.index for c in two.outputs] == [0, 1] and all(c.token_ids == [] for c in two.outputs)
    assert_matches_dense(hf, two.prompt_token_ids, two.prompt_logprobs, 1)
    one_token = llm.generate(["x"], SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
    assert one_token.prompt_logprobs == [None]  # a one-token prompt has nothing to score
    llm.check_integrity()


def test_n_samples_and_delta_outputs(tiny_llama, hf):
    """n = 2 forks after the leader's prompt: the request's prompt logprobs come once, from the leader; a delta
    output carries them in its first output only."""
    llm = LLM(model=str(tiny_llama), max_model_len=256, num_gpu_blocks_override=64)
    out = llm.generate(
        [PROMPTS[0]], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, prompt_logprobs=2), use_tqdm=False
    )[0]
    assert len(out.outputs) == 2 and all(len(c.token_ids) == 5 for c in out.outputs)
    assert_matches_dense(hf, out.prompt_token_ids, out.prompt_logprobs, 2)
    core = llm.engine
    core.add_request("d", out.prompt_token_ids, SamplingParams(max_tokens=3, prompt_logprobs=2, output_kind="delta"))
    carried = []
    while core.has_unfinished_requests():
        carried += [o.prompt_logprobs is not None for o in core.step()]
    assert carried[0] and not any(carried[1:])
    llm.check_integrity()


def test_with_speculative_decoding(tiny_llama, hf):
    """Speculation (the model drafting for itself, so drafts are proposed and verified every step after the
    prompt): the prompt logprobs and greedy tokens are those of a plain engine."""
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(
        model=str(tiny_llama),
        max_model_len=256,
        num_gpu_blocks_override=64,
        max_num_batched_tokens=9,
        speculative_config=spec,
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert_matches_dense(hf, out.prompt_token_ids, out.prompt_logprobs, 1)
    plain = LLM(model=str(tiny_llama), max_model_len=256, num_gpu_blocks_override=64)
    ref = plain.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert llm.stats().spec_decode["num_accepted_tokens"] > 0
    llm.check_integrity()


def test_logits_are_computed_a_bounded_slice_at_a_time(tiny_llama, monkeypatch):
    """A 40-token chunk with the slice capped at 16 rows: three logits calls of at most 16 rows; only the marked
    chunk gets them."""
    monkeypatch.setattr(prompt_outputs, "PROMPT_LOGITS_ROWS", 16)
    llm = LLM(model=str(tiny_llama), max_model_len=256, num_gpu_blocks_override=64)
    runner = llm.engine.executor.runner
    rows: list[int] = []
    real = runner.model.compute_logits

    def counting(h: torch.Tensor) -> torch.Tensor:
        rows.append(h.shape[0])
        return real(h)

    monkeypatch.setattr(runner.model, "compute_logits", counting)
    ids = list(range(100, 140))
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == 40
    assert rows == [16, 16, 7]  # positions 0..38 predict tokens 1..39
    rows.clear()
    llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
    assert rows == [1]  # no prompt logprobs: the last position's logits only


def test_runner_returns_chunks_in_step_output(tiny_llama):
    """The step output's PromptLogprobs: the positions a chunk predicts (start_pos + 1 ...), for marked chunks."""
    llm = LLM(model=str(tiny_llama), max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=5)
    core = llm.engine
    core.add_request("r", list(range(200, 212)), SamplingParams(max_tokens=1, prompt_logprobs=0))
    seen = []
    execute = core.executor.execute

    def spy(step: StepInput):
        out = execute(step)
        marked = [c for c in step.scheduled if c.wants_prompt_logprobs]
        seen.append(([(c.start_pos, c.num_new_tokens) for c in marked], out.prompt_logprobs))
        return out

    core.executor.execute = spy
    while core.has_unfinished_requests():
        core.step()
    marked_chunks = [m for m, _ in seen if m]
    assert marked_chunks == [[(0, 5)], [(5, 5)], [(10, 2)]]
    starts = [(plp["r"].start_pos, len(plp["r"].entries)) for m, plp in seen if m]
    assert starts == [(1, 5), (6, 5), (11, 1)]


def test_preempted_requests_keep_every_position(tiny_llama, hf, monkeypatch):
    """A pool too small for four prompts and their outputs: requests are preempted mid-prompt and recomputed (from
    position 0, their lookups skipped while positions are missing) and still return each position once."""
    recomputed = []
    add = Request.add_prompt_logprobs

    def spy(self: Request, start_pos: int, entries: list) -> None:
        assert self.prompt_logprobs is not None
        recomputed.append(start_pos < len(self.prompt_logprobs))  # positions it already holds
        add(self, start_pos, entries)

    monkeypatch.setattr(Request, "add_prompt_logprobs", spy)
    llm = LLM(
        model=str(tiny_llama),
        max_model_len=256,
        num_gpu_blocks_override=20,
        block_size=4,
        max_num_batched_tokens=8,
    )
    prompts = [f"{i}: " + PROMPTS[0] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats().num_preemptions > 0 and any(recomputed), "the pool was meant to be too small"
    for out in outs:
        assert_matches_dense(hf, out.prompt_token_ids, out.prompt_logprobs, 1)
    llm.check_integrity()


def test_runner_in_another_process(tiny_llama, hf):
    """The mp executor: prompt logprobs and pooled embeddings cross the process boundary in the step output."""
    llm = LLM(model=str(tiny_llama), max_model_len=256, num_gpu_blocks_override=64, distributed_executor_backend="mp")
    try:
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
        assert_matches_dense(hf, out.prompt_token_ids, out.prompt_logprobs, 2)
        emb = torch.tensor(llm.embed(PROMPTS[0], pooling="mean", use_tqdm=False)[0].outputs.embedding)
        with torch.no_grad():
            h = hf.model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
        assert (emb - torch.nn.functional.normalize(h.mean(0), dim=0)).abs().max().item() < 1e-5
        llm.check_integrity()
    finally:
        llm.engine.close()
