"""The sampler's C++ row argmax against torch.argmax."""

from __future__ import annotations

import torch


def test_argmax_rows_matches_torch():
    """The C++ row argmax follows torch's rules: first index of the maximum, NaN counts as the maximum."""
    from tokenmill.layers.sampler import argmax_rows

    g = torch.Generator().manual_seed(0)
    for shape in [(1, 49152), (7, 1000), (3, 17), (2, 16)]:
        x = torch.randn(*shape, generator=g)
        assert torch.equal(argmax_rows(x), x.argmax(-1))
    x = torch.randn(5, 100, generator=g)
    x[0, 30] = x[0, 70] = 50.0  # tie: the first
    x[1, 7] = x[1, 50] = float("nan")  # NaN wins, the first one
    x[2, :] = 1.0  # constant row
    x[3, 5] = x[3, 90] = float("inf")
    x[4, 99] = 60.0  # maximum in the scalar tail
    assert argmax_rows(x).tolist() == x.argmax(-1).tolist() == [30, 7, 0, 5, 99]


def test_inverse_cdf_worked_example_and_zero_weights():
    """The docstring's example; a zero weight is never picked, at any u, even u just below 1."""
    from tokenmill.layers.sampler import sample_inverse_cdf

    w = torch.tensor([[0.2, 0.0, 0.5, 0.3]] * 5)
    u = torch.tensor([0.6, 0.0, 0.2, 0.7, 1 - 2**-53], dtype=torch.float64)
    assert sample_inverse_cdf(w, u).tolist() == [2, 0, 2, 3, 3]
    tail = torch.tensor([[0.25, 0.75, 0.0, 0.0]] * 2)  # unnormalized rows are fine too: x 3
    assert sample_inverse_cdf(tail * 3, torch.tensor([1 - 2**-53, 0.25], dtype=torch.float64)).tolist() == [1, 1]
    # rows without usable mass (extreme sampling parameters) still give a token id, never V
    nan, inf = float("nan"), float("inf")
    bad = torch.tensor([[0.0, 0.0, 0.0, 0.0], [nan, nan, nan, nan], [0.1, inf, 0.2, 0.0], [0.0, 0.0, nan, 0.3]])
    got = sample_inverse_cdf(bad, torch.full((4,), 0.5, dtype=torch.float64))
    assert got.tolist() == bad.argmax(-1).tolist() and bool((got < 4).all())


def test_sampled_tokens_follow_the_distribution_and_seeds_reproduce():
    """sample_from_logits at temperature 1: 40,000 draws of one row match its softmax (chi-square); a seeded
    row draws the same token alone and in a batch."""
    from scipy.stats import chisquare

    from tokenmill.layers.sampler import SamplingMetadata, sample_from_logits

    def meta(n: int, gens) -> SamplingMetadata:
        return SamplingMetadata(torch.ones(n), None, None, None, None, None, None, None, None, None, gens, False, None)

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5])
    n = 40_000
    got = sample_from_logits(logits.repeat(n, 1), meta(n, [None] * n), torch.Generator().manual_seed(0))
    counts = torch.bincount(got, minlength=6)
    assert counts[4] == 0  # masked
    p = logits.softmax(-1)
    keep = p > 0
    expected = p[keep].double() / p[keep].double().sum() * n
    assert chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue > 1e-3
    alone = sample_from_logits(logits[None], meta(1, [torch.Generator().manual_seed(5)]))
    batch = sample_from_logits(
        torch.stack([logits.flip(0), logits]), meta(2, [None, torch.Generator().manual_seed(5)]), torch.Generator()
    )
    assert alone.tolist() == batch[1:].tolist()


def test_a_proposers_stream_is_seeded_apart_from_the_targets():
    """A seeded request's draft stream never replays its target stream (the draft after t1 would otherwise be
    drawn with the very uniform that chose t1); streams of nearby seeds differ too."""
    from tokenmill.layers.sampler import DRAFT_STREAM, TARGET_STREAM, stream_seed

    assert stream_seed(7, TARGET_STREAM) == 7
    seeds = {stream_seed(s, k) for s in range(50) for k in (TARGET_STREAM, DRAFT_STREAM)}
    assert len(seeds) == 100
    first = {torch.rand((), generator=torch.Generator().manual_seed(x)).item() for x in seeds}
    assert len(first) == 100
