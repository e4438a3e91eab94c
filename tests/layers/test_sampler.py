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
