"""N-gram prompt lookup: draft the continuation of the longest suffix that occurred before.

    tokens = [5 7 9 2 | 5 7 9]       suffix n-grams tried longest first (max_n .. min_n)
    n = 3: suffix [5 7 9] also at 0  -> continuation starts at 0 + 3: [2 5 7 9 ...]
    k = 2 -> draft [2, 5]

The most recent earlier occurrence wins (repetition loops repeat their latest period). A
continuation that reaches the end keeps copying its own output, LZ77-style, so a loop of period
P = length - start is drafted for the full k tokens. The
proposer has no probabilities: the rejection sampler treats its drafts as point masses.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.spec_decode.datastore import Continuations, walk
from tokenmill.spec_decode.proposer import DraftRequest, Proposal, draft_budget
from tokenmill.spec_decode.suffix import Layered, OnlineSuffixStore

if TYPE_CHECKING:
    from tokenmill.config import SpeculativeConfig, TreeConfig
    from tokenmill.spec_decode.proposer import ProposerContext


def ngram_propose(token_ids: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens following the latest earlier match of the longest suffix n-gram
    (min_n <= n <= max_n); [] if no suffix of that size occurred before."""
    return ngram_match(token_ids, min_n, max_n, k)[0]


def ngram_match(token_ids: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
    """ngram_propose's drafts and the length n of the suffix matched (0: none)."""
    toks = np.asarray(token_ids, dtype=np.int64)
    length = len(toks)
    if k <= 0:
        return [], 0
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = toks[length - n :]
        # Windows starting at 0 .. length - n - 1 (the suffix itself is excluded).
        windows = np.lib.stride_tricks.sliding_window_view(toks[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            out = toks[start : start + k].tolist()
            while len(out) < k:  # the copy reached the end: keep copying what it drafted (period length - start)
                out.append(out[len(out) - (length - start)])
            return out, n
    return [], 0


PROMPT_MATCH_PRECISION = 0.79
"""How often the token after a >= 2-token prompt match is the target's (measured on the default model's
greedy chat answers, docs/spec_decode.md): a prompt-lookup child's score."""
ONE_TOKEN_MATCH_PRECISION = 0.21
"""The same for one-token matches."""


def _prompt_children(seq: list[int], starts: list[int], precision: float) -> dict[int, tuple[float, list[int]]]:
    """Children from prompt-lookup occurrences: each start is a position in seq whose token continues a
    match; grouped by token, scored by precision times the token's share of the occurrences. Returns
    token -> (score, the occurrences' next positions)."""
    groups: dict[int, list[int]] = {}
    for p in starts:
        if p < len(seq):
            groups.setdefault(seq[p], []).append(p + 1)
    total = sum(len(v) for v in groups.values())
    return {t: (precision * len(v) / total, v) for t, v in groups.items()}


def ngram_tree(
    tokens: list[int],
    max_nodes: int,
    max_width: int,
    max_depth: int,
    min_n: int,
    max_n: int,
    datastore=None,
    min_share: float = 0.3,
    guesses: list[list[tuple[int, float]]] | None = None,
) -> tuple[list[int], list[int]]:
    """A token tree of guesses (tokens, parents; spec_decode/tree.py), grown best first by the product of
    its nodes' scores, a guess of each path's chance to be the target's:

      - prompt lookup: the longest suffix n-gram (n >= 2, or 1 as a last resort) and every earlier
        occurrence of it; a node's children are the tokens after its occurrences (grouped, scored
        PROMPT_MATCH_PRECISION x their share of the occurrences), and a child keeps following its
        occurrences, so a repeated passage is drafted without searching again (LZ77-style: an occurrence
        may run into the path drafted so far);
      - the datastore: the TOP_K continuations of the node's context, scored by their corpus share;
      - guesses[d] (Medusa heads, medusa.py): (token, score) children for every node at depth d, whatever
        its path;
      - a token offered by several sources: 1 - prod(1 - score).

        tokens ... 5 7 9 | 2 ... 5 7 9 | 4 ... 5 7 9       root context ends 5 7 9 (two earlier occurrences)
        root's children: 2 (0.395, from the first), 4 (0.395), the datastore's 9 (0.5) ...
    """
    base = list(tokens)
    nodes: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    matches: list[list[int]] = []  # per node: the positions (in base + its path) its children come from
    paths: list[list[int]] = []

    def candidates(path: list[int], starts: list[int] | None) -> list[tuple[float, int, list[int]]]:
        seq = base + path
        cands: dict[int, tuple[float, list[int]]] = {}
        if starts is None:  # the root: find the occurrences of the longest suffix
            starts = []
            prec = PROMPT_MATCH_PRECISION
            toks = np.asarray(seq, dtype=np.int64)
            for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
                windows = np.lib.stride_tricks.sliding_window_view(toks[: len(seq) - 1], n)
                hits = np.flatnonzero((windows == toks[len(seq) - n :]).all(axis=1))
                if len(hits):
                    if n == 1:
                        prec = ONE_TOKEN_MATCH_PRECISION
                    starts = [int(h) + n for h in hits[::-1]][:8]  # the 8 latest occurrences
                    break
            if prec == ONE_TOKEN_MATCH_PRECISION and datastore is not None and datastore.next_tokens(seq, min_share):
                starts = []  # as the chain policy: a 1-token match only where the datastore has nothing
            cands = _prompt_children(seq, starts, prec)
        elif starts:
            cands = _prompt_children(seq, starts, PROMPT_MATCH_PRECISION)
        offers = datastore.next_tokens(seq, min_share) if datastore is not None else []
        if guesses is not None and len(path) < len(guesses):
            offers = offers + guesses[len(path)]
        for t, sh in offers:
            if t in cands:
                a, occ = cands[t]
                cands[t] = (1 - (1 - a) * (1 - sh), occ)
            else:
                cands[t] = (sh, [])
        ranked = sorted(((sc, t, occ) for t, (sc, occ) in cands.items()), key=lambda x: -x[0])
        return ranked[:max_width]

    heap: list[tuple[float, int, int, int, list[int]]] = []  # (-path score, tie, parent, token, starts)
    tie = 0
    for sc, t, occ in candidates([], None):
        heapq.heappush(heap, (-sc, tie, -1, t, occ))
        tie += 1
    while heap and len(nodes) < max_nodes:
        neg, _, parent, t, occ = heapq.heappop(heap)
        d = 1 if parent < 0 else depth[parent] + 1
        path = (paths[parent] if parent >= 0 else []) + [t]
        nodes.append(t)
        parents.append(parent)
        depth.append(d)
        matches.append(occ)
        paths.append(path)
        if d < max_depth:
            me = len(nodes) - 1
            for sc, t2, occ2 in candidates(path, occ):
                heapq.heappush(heap, (neg * sc, tie, me, t2, occ2))
                tie += 1
    return nodes, parents


class NgramProposer:
    """Prompt lookup over each request's own tokens (prompt and output), optionally backed by a
    suffix datastore of the target's earlier answers (datastore.py) and, for method "suffix", by an online
    store of what the server wrote for the same tenant (suffix.py).

    With a datastore the order is: a prompt match of at least 2 tokens; else the datastore's walk;
    else a one-token prompt match (when min_n is 1). Measured on the default model's greedy chat
    answers (32 held-out ShareGPT prompts, docs/spec_decode.md): one-token prompt matches predict the
    next token 21% of the time, the datastore 46% where no longer prompt match exists. With an online store,
    its walk comes first wherever its context match is at least as long as the prompt match (a repeated task
    repeats whole passages the new prompt does not hold); the offline datastore answers where it has nothing.
    Every finished request's tokens (its prompt's last max_n and its output) go into its tenant's store."""

    def __init__(
        self,
        min_n: int,
        max_n: int,
        datastore=None,
        min_share: float = 0.3,
        tree: TreeConfig | None = None,
        max_depth: int = 4,
        max_model_len: int = 1 << 30,
        online: OnlineSuffixStore | None = None,
    ) -> None:
        self.feature_sink = None  # drafts from tokens only
        self.feature_layers: tuple[int, ...] = ()  # the final hidden states, if any
        self.tree = tree
        """Draft token trees (ngram_tree) instead of chains."""
        self.max_depth = max_depth
        self.max_model_len = max_model_len
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.datastore = datastore
        self.min_share = min_share
        self.online = online
        """method "suffix": the store every finished request feeds and later requests of its tenant draft from."""
        self.rows: dict[str, DraftRequest] = {}
        """With an online store: each live request's row as last proposed for (ingested when it finishes)."""

    @classmethod
    def from_context(cls, config: SpeculativeConfig, ctx: ProposerContext) -> NgramProposer:
        store = None
        if config.datastore:
            from tokenmill.spec_decode.datastore import SuffixDatastore

            store = SuffixDatastore.load(config.datastore)
        online = None
        if config.method == "suffix":
            online = OnlineSuffixStore(config.suffix_max_tokens, min_n=2, max_n=max(2, config.prompt_lookup_max))
        return cls(
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            store,
            config.datastore_min_share,
            config.tree,
            config.tree_max_depth,
            ctx.max_model_len,
            online,
        )

    def continuations(self, tenant: str | None) -> Continuations | None:
        """What the chain walk and the tree ask after prompt lookup: the tenant's online store, then the offline
        datastore (either may be absent)."""
        if self.online is None:
            return self.datastore
        view = self.online.view(tenant)
        return view if self.datastore is None else Layered((view, self.datastore))

    def draft(self, tokens: list[int], k: int, tenant: str | None = None) -> list[int]:
        if k <= 0:
            return []
        if self.datastore is None and self.online is None:
            return ngram_propose(tokens, self.min_n, self.max_n, k)
        out, n = ngram_match(tokens, max(2, self.min_n), self.max_n, k) if self.max_n >= 2 else ([], 0)
        if self.online is not None and self.online.match_length(tenant, tokens) >= max(n, 1):
            walked = walk(self.online.view(tenant), tokens, k, self.min_share, self.online.max_n)
            out = walked or out
        if not out and self.datastore is not None:
            out = self.datastore.draft(tokens, k, self.min_share)
        if not out and self.min_n == 1:
            out = ngram_propose(tokens, 1, 1, k)
        return out

    def propose(self, requests: list[DraftRequest], num_tokens: list[int]) -> Proposal:
        if self.online is not None:
            self.rows.update((r.request_id, r) for r in requests)
        if self.tree is None:
            return Proposal([self.draft(r.all_token_ids, k, r.cache_salt) for r, k in zip(requests, num_tokens)], None)
        drafts, parents = [], []
        for r, k in zip(requests, num_tokens):
            depth = min(k, draft_budget(r, self.max_depth, self.max_model_len))
            toks, par = (
                ngram_tree(
                    r.all_token_ids,
                    k,
                    self.tree.max_width,
                    depth,
                    self.min_n,
                    self.max_n,
                    self.continuations(r.cache_salt),
                    self.min_share,
                )
                if depth > 0
                else ([], [])
            )
            drafts.append(toks)
            parents.append(par)
        return Proposal(drafts, None, parents)

    def forget(self, request_ids: list[str]) -> None:
        """Requests that left: with an online store, their text joins their tenant's store."""
        for rid in request_ids:
            row = self.rows.pop(rid, None)
            if row is not None and self.online is not None:
                start = max(0, len(row.prompt_token_ids) - self.online.max_n)
                self.online.ingest(row.cache_salt, row.all_token_ids[start:])

    def restart(self, request_ids: list[str]) -> None:
        """Rebuilt rows (preemption, a beam taking tokens back): what was seen of them is dropped, not ingested."""
        for rid in request_ids:
            self.rows.pop(rid, None)

    def on_step(self, step: object) -> None:
        pass
