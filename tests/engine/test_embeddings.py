"""Embeddings (LLM.embed, SamplingParams.pooling) against a dense Hugging Face forward of the tiny float32 model:
last-token and mean pooling of the final-normed hidden states, L2-normalised; chunked prefill, a batch and a
prefix-cache-warm engine give the same vectors; Matryoshka truncation."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.outputs import truncate_embedding

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Embeddings pool hidden states",
    "A",
    "In 1905 Einstein published four papers that changed physics: on the photoelectric effect, Brownian motion,",
]


def dense_embedding(hf, ids: list[int], pooling: str) -> torch.Tensor:
    """The oracle: the model body's last hidden state (after the final norm), pooled, L2-normalised."""
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0]  # [T, hidden]
    vec = h[-1] if pooling == "last" else h.mean(0)
    return torch.nn.functional.normalize(vec, dim=0)


def make_llm(path, **kw) -> LLM:
    return LLM(model=str(path), max_model_len=256, num_gpu_blocks_override=64, **kw)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_equals_dense_forward(tiny_llama, hf, pooling):
    """Whole prompts in one step and 5-token chunks: both the oracle's vectors, unit length, hidden-size long."""
    for budget in (512, 5):
        llm = make_llm(tiny_llama, max_num_batched_tokens=budget)
        outs = llm.embed(PROMPTS, pooling=pooling, use_tqdm=False)
        for out in outs:
            got = torch.tensor(out.outputs.embedding)
            assert got.shape == (64,) and got.norm().item() == pytest.approx(1.0, abs=1e-5)
            ref = dense_embedding(hf, out.prompt_token_ids, pooling)
            assert (got - ref).abs().max().item() < 1e-5, (pooling, budget)
        llm.check_integrity()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_batch_equals_one_at_a_time_and_prefix_cache(tiny_llama, pooling):
    """A batch (beside a generating request), then each prompt alone on an engine whose prefix cache holds it:
    the same vectors. Last pooling may take the cached prefix (only the last token's state is read), mean
    pooling recomputes the prompt."""
    llm = make_llm(tiny_llama, block_size=4)
    llm.generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)  # warm the prefix cache
    core = llm.engine
    core.add_request("gen", [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
    batch = llm.embed(PROMPTS, pooling=pooling, use_tqdm=False)
    for prompt, b in zip(PROMPTS, batch):
        alone = llm.embed(prompt, pooling=pooling, use_tqdm=False)[0]
        assert alone.outputs.embedding == pytest.approx(b.outputs.embedding, abs=1e-6)
    cached = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=0, pooling=pooling), use_tqdm=False)[0]
    assert (cached.num_cached_tokens > 0) == (pooling == "last")
    assert cached.outputs[0].token_ids == [] and cached.outputs[0].finish_reason == "length"
    while core.has_unfinished_requests():
        core.step()
    llm.check_integrity()


def test_dimensions_truncate_then_renormalise(tiny_llama):
    llm = make_llm(tiny_llama)
    full = llm.embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding
    short = llm.embed(PROMPTS[0], dimensions=16, use_tqdm=False)[0].outputs.embedding
    head = torch.tensor(full[:16])
    assert short == pytest.approx((head / head.norm()).tolist(), abs=1e-6)
    assert math.fsum(x * x for x in short) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(PROMPTS[0], dimensions=65, use_tqdm=False)
    assert truncate_embedding([0.6, 0.8, 0.0], 1) == [1.0]


def test_pooling_params_are_checked():
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=0, pooling="cls")
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=4, pooling="last")
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
