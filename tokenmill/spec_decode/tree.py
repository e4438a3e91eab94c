"""Exact verification of a token tree: which drafted path the target accepts, and the token that follows.

A tree hangs below a request's last real token (the root). Nodes are listed parents first; siblings are
tried in their listed order. Row 0 of the target's probabilities is the root's (the distribution of the
first new token), row 1 + i node i's (the distribution after node i's path). A sampled node was drawn
i.i.d. from its parent's draft distribution q (row of the parent in `draft_probs`); a deterministic node
was chosen (top-k of q, a datastore match, a Medusa head's top tokens) and counts as a point mass.

Sampling, at node u with target distribution p_u (after temperature, top-k/p, min-p and penalties, as
the normal sampler applies them), the SpecInfer-style recursive rule:

    r = p_u
    for each child c of u, in order (its token x, drawn from s = q_u, or s = point mass at x):
        accept c with probability min(1, r(x) / s(x)); if accepted, continue from c
        else r = normalize(max(r - s, 0))          the residual, updated after every rejected sibling
    no child accepted (or u is a leaf): emit one token drawn from r (at a leaf r = p_u: the bonus token)

Each step emits exactly a sample of r: accepting x gives min(r, s), rejecting leaves the mass
r - min(r, s), which the residual carries to the next sibling. So the emitted sequence is distributed
exactly as the target's own sampling, whatever the draft. Greedy rows take the longest path whose every
token is the target's argmax, then the argmax after it.

Worked example (greedy), a tree of 4 nodes below the root R:

    node  token  parent        target argmax at   R: 7   node 0: 3   node 1: -   node 2: 5   node 3: 9
    0     7      R (-1)
    1     8      R (-1)        at R the argmax 7 matches node 0 (node 1's 8 is not tried further)
    2     3      0             at node 0 the argmax 3 matches node 2
    3     4      2             at node 2 the argmax is 5, no child has it: stop
    -> accepted nodes [0, 2], emitted tokens [7, 3, 5] (two drafts accepted and the target's next token)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.attention.metadata import tree_depths
from tokenmill.core.step_io import SamplerResult, SamplingRow, StepTokens
from tokenmill.layers.sampler import SamplingMetadata, apply_penalties, apply_temperature_and_masks, gather_logprobs
from tokenmill.spec_decode.rejection_sampler import expand_rows
from tokenmill.spec_decode.stats import SpecDecodeStats


@dataclass(frozen=True)
class TokenTree:
    tokens: list[int]
    """Node i's draft token."""
    parents: list[int]
    """Node i's parent node; -1 is the root (the request's last real token). Parents come first."""
    sampled: list[bool]
    """Node i was drawn from its parent's q (True) or chosen deterministically (False)."""

    def __post_init__(self) -> None:
        if not (len(self.tokens) == len(self.parents) == len(self.sampled)):
            raise ValueError("tokens, parents and sampled must have one entry per node")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i}'s parent {p} must be -1 or an earlier node")

    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        """children()[1 + u]: node u's children in order; children()[0]: the root's."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out

    def depths(self) -> list[int]:
        """Depth of each node (root's children: 1): its position is the root's + depth."""
        return tree_depths(self.parents)

    def ancestors_mask(self) -> torch.Tensor:
        """[size, size] bool, True where node j is node i or one of its ancestors: what node i attends to
        among the tree's own tokens (besides the request's prefix)."""
        m = torch.zeros(self.size, self.size, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            m[i, i] = True
            if p >= 0:
                m[i] |= m[p]
        return m

    def positions(self, root_pos: int) -> list[int]:
        """Positions of the step's tokens [root, node 0, ...]: the root (the request's last real token) at
        root_pos, each node at root_pos + its depth."""
        return [root_pos] + [root_pos + d for d in self.depths()]

    def attention_mask(self, num_cached: int) -> torch.Tensor:
        """[1 + size, num_cached + 1 + size] bool: which keys each of the step's tokens [root, node 0, ...]
        attends to, keys in the request's slot order (the cached prefix, then the root, then the nodes in
        listing order). Every token sees the prefix and the root; node i also sees its ancestors and itself.

            num_cached 2, tree [a, b (child of a), c]:     keys  p0 p1 R  a  b  c
                root                                           1  1  1  .  .  .
                a                                              1  1  1  1  .  .
                b                                              1  1  1  1  1  .
                c                                              1  1  1  .  .  1
        """
        n = num_cached + 1
        m = torch.zeros(1 + self.size, n + self.size, dtype=torch.bool)
        m[:, :n] = True
        m[1:, n:] = self.ancestors_mask()
        return m

    def path(self, node: int) -> list[int]:
        """Tokens from the root's first child down to `node` (its ancestors, then itself)."""
        out: list[int] = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def max_depth(self) -> int:
        return max(self.depths(), default=0)

    @classmethod
    def chain(cls, tokens: list[int], sampled: bool = True) -> TokenTree:
        """A chain of drafts: the special case of a tree."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), [sampled] * len(tokens))


@dataclass(frozen=True)
class TreeVerdict:
    accepted: list[int]
    """Accepted nodes, root to deepest."""
    token_ids: list[int]
    """Emitted tokens: the accepted nodes' tokens, then one token of the target's (residual or bonus)."""


def verify_tree(
    tree: TokenTree,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> TreeVerdict:
    """One request's tree. target_probs [1 + size, V]; draft_probs [1 + size, V] (row of a node's parent:
    the q its sampled children were drawn from), None when no node is sampled (or greedy)."""
    if target_probs.shape[0] != tree.size + 1:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, the tree needs {tree.size + 1}")
    if greedy:
        return greedy_tree_walk(tree, target_probs.argmax(-1).tolist())
    kids = tree.children()
    accepted: list[int] = []
    row = 0  # 0: the root; 1 + u: node u
    if draft_probs is None and any(tree.sampled):
        raise ValueError("sampled nodes need draft_probs")
    dev = target_probs.device
    while True:
        r = target_probs[row].to(torch.float64)
        moved = False
        for c in kids[row]:
            x = tree.tokens[c]
            if tree.sampled[c]:
                assert draft_probs is not None  # checked above: sampled nodes need draft_probs
                s = draft_probs[row].to(torch.float64)
            else:
                s = torch.zeros_like(r)
                s[x] = 1.0
            u = float(torch.rand((), generator=generator, device=dev, dtype=torch.float64))
            if s[x] > 0 and u < min(1.0, float(r[x] / s[x])):
                accepted.append(c)
                row = c + 1
                moved = True
                break
            rest = (r - s).clamp_min(0)
            total = float(rest.sum())
            if total > 0:  # (0 only when r <= s everywhere, i.e. r == s: then x was accepted surely)
                r = rest / total
        if not moved:
            final = int(torch.multinomial(r.to(torch.float32), 1, generator=generator))
            return TreeVerdict(accepted, [tree.tokens[c] for c in accepted] + [final])


def greedy_tree_walk(tree: TokenTree, argmax: list[int]) -> TreeVerdict:
    """Greedy verification from the rows' argmax tokens ([1 + size]: root, then node i at 1 + i)."""
    kids = tree.children()
    accepted: list[int] = []
    row = 0
    while True:
        best = argmax[row]
        nxt = next((c for c in kids[row] if tree.tokens[c] == best), None)
        if nxt is None:
            return TreeVerdict(accepted, [tree.tokens[c] for c in accepted] + [best])
        accepted.append(nxt)
        row = nxt + 1


class TreeVerifier:
    """The runner's verification hook for steps whose drafts are token trees (a chain is a tree too): applies
    each request's sampling parameters to every row, with node i's path counted as already generated (so
    penalties and min_tokens act as one-token-at-a-time sampling would), verifies each tree, gathers the
    emitted tokens' logprobs and counts acceptances. Row layout: request i owns 1 + k_i rows, its root first,
    then its nodes in listing order (the runner's logits rows for it).

    draft_probs[request id]: [>= 1 + size, V], row 0 the distribution at the root and row 1 + u at node u:
    the q that node u's sampled children were drawn from (a chain's [k, V] rows are the same thing)."""

    def __init__(self, stats: SpecDecodeStats) -> None:
        self.stats = stats

    def __call__(
        self,
        logits: torch.Tensor,
        sampling: list[StepTokens],
        reqs: Sequence[SamplingRow],
        meta: SamplingMetadata,
        draft_probs: dict[str, torch.Tensor],
        global_gen: torch.Generator | None,
    ) -> dict[str, SamplerResult]:
        trees: list[TokenTree] = []
        for s in sampling:
            k = s.num_spec_tokens if s.is_sampling else 0
            toks = s.token_ids[len(s.token_ids) - k :] if k else []
            parents = list(s.spec_parents[:k]) if s.spec_parents is not None else list(range(-1, k - 1))
            trees.append(TokenTree(toks, parents, [s.request_id in draft_probs] * k))
        prefixes: list[list[list[int]]] = [[[]] + [t.path(i) for i in range(t.size)] for t in trees]
        emeta = expand_rows(
            meta, prefixes, [r.num_output_tokens for r in reqs], [r.sampling_params.min_tokens for r in reqs]
        )
        logits = apply_penalties(logits.float(), emeta)
        raw_logprobs = logits.log_softmax(-1) if meta.max_num_logprobs is not None else None
        processed = apply_temperature_and_masks(logits, emeta)
        argmax = processed.argmax(-1).tolist()
        probs = None if meta.all_greedy else processed.softmax(-1)
        out: dict[str, SamplerResult] = {}
        row0 = 0
        for i, (s, r, tree) in enumerate(zip(sampling, reqs, trees)):
            n = tree.size + 1
            if r.sampling_params.is_greedy:
                v = greedy_tree_walk(tree, argmax[row0 : row0 + n])
            else:
                assert probs is not None  # a row that is not greedy: meta is not all greedy
                q = draft_probs.get(s.request_id)
                gen = meta.generators[i] if meta.generators[i] is not None else global_gen
                v = verify_tree(tree, probs[row0 : row0 + n], None if q is None else q.to(probs.device), False, gen)
            lp = None
            if raw_logprobs is not None and r.sampling_params.logprobs is not None:
                rows = [row0] + [row0 + 1 + a for a in v.accepted]  # the row each emitted token came from
                lp = gather_logprobs(
                    raw_logprobs[torch.tensor(rows, device=logits.device)],
                    torch.tensor(v.token_ids, device=logits.device),
                    [r.sampling_params.logprobs] * len(rows),
                )
            self.stats.observe(tree.size, len(v.accepted), tree.max_depth())
            out[s.request_id] = SamplerResult(v.token_ids, lp, v.accepted if tree.size else None)
            row0 += n
        return out
