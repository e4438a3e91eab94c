"""Constrained sampling is the target distribution renormalised over the allowed tokens: the plain sampler and
the rejection sampler (drafts drawn without the grammar), on toy distributions, by chi-square tests."""

from __future__ import annotations

import numpy as np
import torch

from tests.spec_decode.test_rejection_sampler import _meta, _toy, chisquare_pvalue
from tokenmill.layers.sampler import (
    Sampler,
    apply_penalties,
    apply_temperature_and_masks,
    masks_from_bytes,
    unpack_token_bitmask,
)
from tokenmill.spec_decode.rejection_sampler import expand_rows, rejection_sample


def renormalised(p: torch.Tensor, allowed: torch.Tensor) -> np.ndarray:
    q = torch.where(allowed, p, torch.zeros_like(p))
    return (q / q.sum()).numpy()


def test_bitmask_layout_worked_example():
    words = torch.tensor([[0b101, 0b10]], dtype=torch.int32)
    assert unpack_token_bitmask(words, 40)[0].nonzero().flatten().tolist() == [0, 2, 33]
    full = torch.tensor([[-1, -1]], dtype=torch.int32)  # every bit set, the sign bit included
    assert unpack_token_bitmask(full, 64).all()
    two_rows = np.array([[-(1 << 31), 0], [0, 1]], dtype=np.int32).tobytes()  # bit 31 of row 0, bit 0 of word 1
    assert masks_from_bytes(two_rows, 2, 40).nonzero().tolist() == [[0, 31], [1, 32]]


def test_sampler_draws_from_the_renormalised_target():
    p, _ = _toy(5, vocab=8)
    allowed = torch.tensor([True, False, True, True, False, True, False, True])
    n = 40_000
    meta = _meta(n, 8, allowed=allowed.repeat(n, 1))
    out = Sampler(global_seed=0)(p[0].log().repeat(n, 1), meta, [None] * n)  # (a 1% test: seed 3 fails masked or not)
    counts = np.bincount(out.token_ids.numpy(), minlength=8)
    assert counts[~allowed.numpy()].sum() == 0
    target = renormalised(p[0], allowed)
    assert chisquare_pvalue(counts, counts.sum() * target) > 0.01
    greedy = Sampler()(
        p[0].log()[None], _meta(1, 8, temperature=torch.zeros(1), all_greedy=True, allowed=allowed[None]), [None]
    )
    assert greedy.token_ids.item() == int(torch.where(allowed, p[0], -1.0).argmax())


def test_rejection_sampler_with_unconstrained_drafts_emits_the_constrained_target():
    """Drafts come from q, which ignores the grammar; the verifier's rows carry a different mask per position.
    First token ~ p_0 renormalised over mask_0; second (first draft accepted) ~ p_1 over mask_1."""
    vocab, k, n = 6, 2, 40_000
    p, q = _toy(7, vocab=vocab, k=k)
    masks = torch.tensor(
        [
            [True, True, False, True, False, True],
            [False, True, True, True, True, False],
            [True, True, True, True, True, True],
        ]
    )
    g = torch.Generator().manual_seed(11)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)
    meta = _meta(n, vocab, allowed_per_position=[masks] * n)
    emeta = expand_rows(meta, [[d[:j].tolist() for j in range(k + 1)] for d in drafts], [0] * n, [0] * n)
    assert emeta.allowed.shape == (n * (k + 1), vocab)
    logits = apply_temperature_and_masks(apply_penalties(p.log().repeat(n, 1), emeta), emeta)
    uniforms = torch.rand(n * k, generator=g)
    sample_u = torch.rand(n, generator=g, dtype=torch.float64)
    out = rejection_sample(
        logits, drafts.flatten(), q.repeat(n, 1), [k] * n, torch.zeros(n, dtype=torch.bool), uniforms, sample_u
    )
    first = np.bincount([t[0] for t in out.output_token_ids], minlength=vocab)
    second = np.bincount([t[1] for t in out.output_token_ids if len(t) > 1], minlength=vocab)
    for counts, row in ((first, 0), (second, 1)):
        assert counts[~masks[row].numpy()].sum() == 0, f"a banned token was emitted at position {row}"
        target = renormalised(p[row], masks[row])
        assert chisquare_pvalue(counts, counts.sum() * target) > 0.01
    # drafts the grammar bans are never accepted
    banned_first = ~masks[0][drafts[:, 0]]
    assert all(a == 0 for a, b in zip(out.num_accepted, banned_first.tolist()) if b)
