"""The rejection sampler as pure functions: the seeds' worked example, greedy rules, and
statistical exactness on toy target/draft pairs with known p and q."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.layers.sampler import SamplingMetadata
from tokenmill.spec_decode.rejection_sampler import (
    acceptance_probs,
    draw_randomness,
    expand_sampling_metadata,
    rejection_sample,
    residual_distribution,
)


def test_seeds_worked_example():
    q = torch.tensor([[0.10, 0.60, 0.20, 0.10]])
    p = torch.tensor([[0.05, 0.30, 0.55, 0.10]])
    x = torch.tensor([1])
    assert acceptance_probs(p, q, x).item() == pytest.approx(0.5)
    assert residual_distribution(p, q, x)[0].tolist() == pytest.approx([0.0, 0.0, 1.0, 0.0])


def test_point_mass_residual_removes_the_draft():
    p = torch.tensor([[0.2, 0.5, 0.3]])
    assert acceptance_probs(p, None, torch.tensor([1])).item() == pytest.approx(0.5)
    assert residual_distribution(p, None, torch.tensor([1]))[0].tolist() == pytest.approx([0.4, 0.0, 0.6])


def test_greedy_accepts_exactly_while_drafts_match_argmax():
    # Request A: 3 drafts, argmax per row [2, 0, 1, 3] -> drafts [2, 0, 3] accept 2, emit argmax 1.
    # Request B: 1 draft matching -> accept it and emit the bonus argmax. Request C: no drafts.
    logits = torch.full((4 + 2 + 1, 4), -5.0)
    for row, tok in enumerate([2, 0, 1, 3, 1, 2, 0]):
        logits[row, tok] = 5.0
    out = rejection_sample(
        logits, torch.tensor([2, 0, 3, 1]), None, [3, 1, 0], torch.tensor([True, True, True]), None, None
    )
    assert out.output_token_ids == [[2, 0, 1], [1, 2], [0]]
    assert out.num_accepted == [2, 1, 0]
    assert out.final_rows.tolist() == [2, 5, 6]


def _toy(seed: int, vocab: int = 6, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, vocab, generator=g) ** 3
    q = torch.rand(k, vocab, generator=g) ** 3
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _simulate(p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int, point_draft: int = 0):
    """n requests, each with k drafts (x_j ~ q_j, or a fixed token for point masses), the same
    context-free target rows p_1..p_{k+1}. Returns emitted token lists."""
    k = p.shape[0] - 1
    g = torch.Generator().manual_seed(seed)
    if q is None:
        drafts = torch.full((n, k), point_draft, dtype=torch.long)
    else:
        drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)
    logits = p.log().repeat(n, 1)  # [n * (k + 1), V]
    dprobs = None if q is None else q.repeat(n, 1)  # [n * k, V]
    uniforms = torch.rand(n * k, generator=g)
    sample_u = torch.rand(n, generator=g, dtype=torch.float64)
    out = rejection_sample(
        logits, drafts.flatten(), dprobs, [k] * n, torch.zeros(n, dtype=torch.bool), uniforms, sample_u
    )
    return out


def chisquare_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square test (no scipy here): P(X >= stat), X ~ chi2(categories - 1)."""
    keep = expected > 0
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


@pytest.mark.parametrize("point_mass", [False, True])
def test_emitted_tokens_follow_the_target(point_mass):
    p, q = _toy(0)
    n = 40_000
    out = _simulate(p, None if point_mass else q, n, seed=1, point_draft=1)
    first = np.bincount([t[0] for t in out.output_token_ids], minlength=p.shape[1])
    # Second token, given the first draft was accepted: its distribution is p_2 again.
    second = np.bincount([t[1] for t in out.output_token_ids if len(t) > 1], minlength=p.shape[1])
    for counts, target in ((first, p[0].numpy()), (second, p[1].numpy())):
        assert chisquare_pvalue(counts, counts.sum() * target) > 0.01
        assert _tv(counts, target) < 0.02
    # The acceptance rate of the first draft is E_q[min(1, p/q)] = 1 - TV(p, q) (point mass: p(x)).
    expect = p[0, 1].item() if point_mass else 1 - 0.5 * (p[0] - q[0]).abs().sum().item()
    assert np.mean([a >= 1 for a in out.num_accepted]) == pytest.approx(expect, abs=0.01)


def test_tv_distance_falls_with_sample_count():
    p, q = _toy(3)
    tvs = []
    for n in (100, 2_000, 40_000):  # mean over 4 seeds: TV shrinks like 1 / sqrt(n)
        tv = 0.0
        for seed in range(4):
            out = _simulate(p, q, n, seed=seed)
            counts = np.bincount([t[0] for t in out.output_token_ids], minlength=p.shape[1])
            tv += _tv(counts, p[0].numpy()) / 4
        tvs.append(tv)
    assert tvs[0] > tvs[1] > tvs[2]
    assert tvs[2] < 0.01


def _meta(n: int, vocab: int, **kw) -> SamplingMetadata:
    base = dict(
        temperature=torch.ones(n),
        top_k=None,
        top_p=None,
        min_p=None,
        presence_penalty=None,
        frequency_penalty=None,
        repetition_penalty=None,
        output_counts=None,
        prompt_mask=None,
        min_tokens_mask=None,
        generators=[None] * n,
        all_greedy=False,
        max_num_logprobs=None,
    )
    base.update(kw)
    return SamplingMetadata(**base)


def test_expanded_metadata_counts_earlier_drafts_as_generated():
    # Request 0: 2 drafts [3, 3] after outputs counted [1 at token 0]; request 1: no drafts.
    counts = torch.zeros(2, 5)
    counts[0, 0] = 1
    ban = torch.zeros(2, 5, dtype=torch.bool)
    ban[0, 4] = True  # EOS banned: 1 output so far, min_tokens 3
    meta = _meta(2, 5, frequency_penalty=torch.tensor([0.5, 0.0]), output_counts=counts, min_tokens_mask=ban)
    e = expand_sampling_metadata(meta, [[3, 3], []], num_output_tokens=[1, 0], min_tokens=[3, 0])
    assert e.temperature.shape == (4,)
    assert e.output_counts[:3, 3].tolist() == [0, 1, 2]  # row j sees drafts[:j]
    assert e.output_counts[:3, 0].tolist() == [1, 1, 1]
    assert e.min_tokens_mask[:3, 4].tolist() == [True, True, False]  # 1 + j outputs >= 3 at j = 2
    assert e.frequency_penalty.tolist() == [0.5, 0.5, 0.5, 0.0]


def test_seeded_rows_do_not_depend_on_the_batch():
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    u1, n1 = draw_randomness([2], [g1], torch.device("cpu"), torch.Generator().manual_seed(0))
    u2, n2 = draw_randomness([3, 2], [None, g2], torch.device("cpu"), torch.Generator().manual_seed(1))
    assert torch.equal(u1, u2[3:]) and torch.equal(n1[0], n2[1])
