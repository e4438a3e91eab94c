"""Exact tree verification (spec_decode/tree.py): the emitted tokens follow the target's own distribution
for trees of width 2-4 and depth 3, with sampled and deterministic siblings; greedy takes the longest
argmax path (the docstring's worked example)."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch

from tests.spec_decode.test_rejection_sampler import chisquare_pvalue
from tokenmill.spec_decode.tree import TokenTree, verify_tree

V = 5


@functools.cache
def dist(ctx: tuple[int, ...], salt: int) -> torch.Tensor:
    """A fixed distribution over V tokens for each context (the 'model'): target salt 0, draft salt 1."""
    g = torch.Generator().manual_seed(hash((ctx, salt)) % (2**31))
    x = torch.rand(V, generator=g, dtype=torch.float64) ** 2 + 0.02
    return x / x.sum()


def draft_tree(width: int, depth: int, deterministic: bool, gen: torch.Generator) -> tuple[TokenTree, list]:
    """A full tree: every node at depth < `depth` gets `width` children, drawn i.i.d. from the draft q of
    their path (sampled) or q's top `width` tokens (deterministic). Returns the tree and each node's path."""
    tokens, parents, sampled, paths = [], [], [], []
    frontier = [(-1, ())]
    for _ in range(depth):
        nxt = []
        for parent, path in frontier:
            q = dist(path, 1)
            kids = (
                torch.topk(q, width).indices.tolist()
                if deterministic
                else torch.multinomial(q.float(), width, replacement=True, generator=gen).tolist()
            )
            for t in kids:
                tokens.append(t)
                parents.append(parent)
                sampled.append(not deterministic)
                paths.append(path + (t,))
                nxt.append((len(tokens) - 1, path + (t,)))
        frontier = nxt
    return TokenTree(tokens, parents, sampled), paths


def run_once(width: int, depth: int, deterministic: bool, gen: torch.Generator) -> list[int]:
    tree, paths = draft_tree(width, depth, deterministic, gen)
    ctxs = [()] + paths
    p = torch.stack([dist(c, 0) for c in ctxs])
    q = torch.stack([dist(c, 1) for c in ctxs])
    out = verify_tree(tree, p, q, greedy=False, generator=gen).token_ids
    while len(out) < 2:  # the next round would sample the rest from the target itself
        out.append(int(torch.multinomial(dist(tuple(out), 0).float(), 1, generator=gen)))
    return out[:2]


@pytest.mark.parametrize("width,deterministic", [(2, False), (3, False), (4, False), (2, True), (3, True)])
def test_first_two_tokens_follow_the_target(width, deterministic):
    gen = torch.Generator().manual_seed(width * 10 + deterministic)
    n = 8_000
    counts = np.zeros(V * V)
    for _ in range(n):
        a, b = run_once(width, 3, deterministic, gen)
        counts[a * V + b] += 1
    joint = np.array([float(dist((), 0)[a] * dist((a,), 0)[b]) for a, b in itertools.product(range(V), range(V))])
    assert chisquare_pvalue(counts, n * joint) > 0.001
    assert 0.5 * np.abs(counts / n - joint).sum() < 0.04


def test_mixed_sampled_and_deterministic_siblings():
    """Under one parent: q's top token tried first (a point mass), then two i.i.d. samples of q."""
    gen = torch.Generator().manual_seed(5)
    p0, q0 = dist((), 0), dist((), 1)
    n = 20_000
    counts = np.zeros(V)
    for _ in range(n):
        top = int(q0.argmax())
        drawn = torch.multinomial(q0.float(), 2, replacement=True, generator=gen).tolist()
        tree = TokenTree([top] + drawn, [-1, -1, -1], [False, True, True])
        probs = torch.stack([p0] + [dist((t,), 0) for t in [top] + drawn])
        qs = torch.stack([q0] + [dist((t,), 1) for t in [top] + drawn])
        counts[verify_tree(tree, probs, qs, greedy=False, generator=gen).token_ids[0]] += 1
    assert chisquare_pvalue(counts, n * p0.numpy()) > 0.001


def test_greedy_worked_example():
    tree = TokenTree([7, 8, 3, 4], [-1, -1, 0, 2], [False] * 4)
    argmax = [7, 3, 0, 5, 9]  # rows: root, node 0, node 1, node 2, node 3
    probs = torch.full((5, 10), 0.01)
    for r, a in enumerate(argmax):
        probs[r, a] = 1.0
    v = verify_tree(tree, probs, None, greedy=True)
    assert v.accepted == [0, 2] and v.token_ids == [7, 3, 5]


def test_tree_structure_helpers():
    tree = TokenTree([7, 8, 3, 4], [-1, -1, 0, 2], [True] * 4)
    assert tree.depths() == [1, 1, 2, 3]
    assert tree.children() == [[0, 1], [2], [], [3], []]
    assert tree.ancestors_mask().tolist() == [
        [True, False, False, False],
        [False, True, False, False],
        [True, False, True, False],
        [True, False, True, True],
    ]
    chain = TokenTree.chain([4, 5, 6])
    assert chain.parents == [-1, 0, 1]
    with pytest.raises(ValueError):
        TokenTree([1, 2], [1, -1], [True, True])


def test_a_chain_of_point_masses_accepts_what_the_target_allows():
    """A chain whose drafts the target gives probability 1 is accepted whole, plus a bonus token."""
    tree = TokenTree.chain([1, 2], sampled=False)
    probs = torch.zeros(3, V, dtype=torch.float64)
    probs[0, 1] = probs[1, 2] = 1.0
    probs[2, 4] = 1.0
    v = verify_tree(tree, probs, None, greedy=False, generator=torch.Generator().manual_seed(0))
    assert v.accepted == [0, 1] and v.token_ids == [1, 2, 4]
