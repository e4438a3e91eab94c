"""Sampler: allowed sets under top-k / top-p / min-p (property tests), temperature-1 sampling
matches the softmax (chi-square at a fixed seed), per-request seeds."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.layers.sampler import Sampler, SamplingMetadata, apply_temperature_and_masks, process_logits


def meta_for(n: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generators=None) -> SamplingMetadata:
    t = torch.full((n,), float(temperature))
    return SamplingMetadata(
        temperature=t,
        top_k=torch.full((n,), top_k, dtype=torch.long) if top_k else None,
        top_p=torch.full((n,), float(top_p)) if top_p < 1 else None,
        min_p=torch.full((n,), float(min_p)) if min_p > 0 else None,
        presence_penalty=None,
        frequency_penalty=None,
        repetition_penalty=None,
        output_counts=None,
        prompt_mask=None,
        min_tokens_mask=None,
        generators=generators or [None] * n,
        all_greedy=temperature == 0,
        max_num_logprobs=None,
    )


def allowed_set(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Independent definition of the tokens each filter allows, from sorted probabilities."""
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True).tolist()
    keep = set(range(len(order)))
    if top_k:
        kth = probs[order[top_k - 1]]
        keep &= {i for i in range(len(order)) if probs[i] >= kth}
    if top_p < 1:
        mass, nucleus = 0.0, set()
        for i in order:
            nucleus.add(i)
            mass += probs[i].item()
            if mass >= top_p - 1e-6:
                break
        keep &= nucleus | {
            i for i in range(len(order)) if probs[i] >= probs[max(nucleus, key=lambda j: -probs[j])]
        }  # ties
    if min_p > 0:
        keep &= {i for i in range(len(order)) if probs[i] >= min_p * probs.max() - 1e-9}
    return keep


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), top_k=st.integers(0, 8), top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.9))
def test_filters_never_emit_outside_allowed_set(seed, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 32, generator=g) * 3
    meta = meta_for(400, top_k=top_k, top_p=top_p, min_p=min_p)
    # each filter alone, checked against its own definition
    for k, p, m in ((top_k, 1.0, 0.0), (0, top_p, 0.0), (0, 1.0, min_p)):
        meta = meta_for(400, top_k=k, top_p=p, min_p=m)
        allowed = allowed_set(logits[0], k, p, m)
        toks = Sampler(seed)(logits.repeat(400, 1), meta, [None] * 400).token_ids.tolist()
        assert set(toks) <= allowed, (k, p, m)
    # combined: the masked distribution has support only inside the intersection
    meta = meta_for(1, top_k=top_k, top_p=top_p, min_p=min_p)
    masked = apply_temperature_and_masks(logits.clone(), meta)
    support = set(torch.nonzero(masked[0] > float("-inf")).flatten().tolist())
    assert support and support <= allowed_set(logits[0], top_k, 1.0, 0.0)


def test_temperature_one_matches_softmax_chi_square():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 1.5
    n = 40_000
    toks = Sampler(123)(logits.repeat(n, 1), meta_for(n), [None] * n).token_ids
    counts = torch.bincount(toks, minlength=12).double()
    expected = logits.softmax(-1)[0].double() * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    # 11 degrees of freedom: the 99.9% quantile is 31.26.
    assert chi2 < 31.26, chi2


def test_temperature_scales_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 40_000
    toks = Sampler(7)(logits.repeat(n, 1), meta_for(n, temperature=0.5), [None] * n).token_ids
    freq = torch.bincount(toks, minlength=4).double() / n
    expected = (logits / 0.5).softmax(-1)[0].double()
    assert (freq - expected).abs().max() < 0.01


def test_seeded_rows_independent_of_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    gen = lambda: torch.Generator().manual_seed(42)  # noqa: E731
    alone = Sampler(0)(logits[2:3], meta_for(1, generators=[gen()]), [None]).token_ids.item()
    gens = [None, None, gen(), None, None, None]
    together = Sampler(99)(logits, meta_for(6, generators=gens), [None] * 6).token_ids[2].item()
    assert alone == together


def test_greedy_is_argmax_and_logprobs():
    logits = torch.randn(3, 20)
    out = Sampler(0)(logits, meta_for(3, temperature=0.0), [2, None, 0])
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    lp = logits.log_softmax(-1)
    d = out.logprobs[0]
    top2 = lp[0].topk(2).indices.tolist()
    assert set(top2) <= set(d) and d[top2[0]].rank == 1
    assert math.isclose(d[top2[0]].logprob, lp[0, top2[0]].item(), rel_tol=1e-5)
    assert out.logprobs[1] is None and len(out.logprobs[2]) == 1


def test_penalties():
    logits = torch.zeros(1, 5)
    meta = meta_for(1, temperature=0.0)
    meta.output_counts = torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0]])
    meta.frequency_penalty = torch.tensor([0.5])
    meta.presence_penalty = torch.tensor([0.25])
    out = process_logits(logits, meta)
    assert out[0].tolist() == [0.0, -1.25, -0.75, 0.0, 0.0]
