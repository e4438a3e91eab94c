"""A suffix datastore for the n-gram proposer: drafts from text the target wrote before.

Prompt lookup (ngram.py) only finds continuations inside the request itself. Early in a fresh chat
reply there is often nothing to copy, or only a one-token match, and those drafts are mostly
rejected. Retrieval-based drafting (He et al., "REST", 2023) instead looks the recent suffix up in
a large corpus. Here the corpus is the target's own greedy answers to chat prompts
(`tokenmill build-datastore`), so a retrieved continuation is what this model tends to say after
those words.

Layout: for each context length n in [min_n, max_n], every n-token context seen in the corpus is
reduced to a 64-bit hash, and keeps its TOP_K most frequent next tokens and their shares of the
context's occurrences (the first for chains, all of them as siblings in a token tree). The table is
three numpy arrays per n (sorted hashes [U], next tokens [U, TOP_K] padded with -1, shares [U, TOP_K]),
so lookups use `np.searchsorted`. It has no Python object per entry: the default model's 557 k-token
datastore has 0.99 M entries in 15.8 MB.

Drafting walks greedily: the longest context with an entry whose share is at least `min_share`
gives the next token. That token is appended, and the walk repeats for up to k tokens. A hash
collision can only produce a bad draft. The rejection sampler still decides, so output stays
exact.

File format (`.npz`): `tokens`, int32, the corpus sequences concatenated, each one ended by -1;
`max_n`; `min_n`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

_MULT = np.uint64(0x9E3779B97F4A7C15)
_MASK = np.uint64((1 << 64) - 1)
TOP_K = 3
"""Continuations kept per context."""


def _hash_windows(tokens: np.ndarray, n: int) -> np.ndarray:
    """Hash of every n-token window of tokens (int64 array, length L) -> uint64 [L - n + 1]."""
    L = len(tokens)
    h = np.zeros(L - n + 1, dtype=np.uint64)
    t = tokens.astype(np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = (h * _MULT + t[j : L - n + 1 + j] + np.uint64(1)) & _MASK
    return h


def _hash_one(ctx: Sequence[int]) -> np.uint64:
    """The hash _hash_windows gives this window (in Python ints: ~10x faster than numpy scalars)."""
    h, m = 0, int(_MULT)
    for tok in ctx:
        h = (h * m + int(tok) + 1) & 0xFFFFFFFFFFFFFFFF
    return np.uint64(h)


class SuffixDatastore:
    """Most frequent continuation of every n-token context (min_n <= n <= max_n) of a token corpus."""

    def __init__(
        self, tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], min_n: int, max_n: int, num_tokens: int
    ) -> None:
        self.tables = tables
        self.min_n = min_n
        self.max_n = max_n
        self.num_tokens = num_tokens

    # --------------------------------------------------------------- building
    @classmethod
    def build(cls, sequences: list[list[int]], min_n: int = 2, max_n: int = 6) -> SuffixDatastore:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        flat = (
            np.concatenate([np.append(np.asarray(s, dtype=np.int64), -1) for s in sequences])
            if sequences
            else np.zeros(0, dtype=np.int64)
        )
        return cls.from_tokens(flat, min_n, max_n)

    @classmethod
    def from_tokens(cls, flat: np.ndarray, min_n: int, max_n: int) -> SuffixDatastore:
        """flat: sequences concatenated, each ended by -1 (contexts never cross a -1)."""
        flat = np.asarray(flat, dtype=np.int64)
        sep = flat < 0
        tables = {}
        for n in range(min_n, max_n + 1):
            if len(flat) <= n:
                tables[n] = (np.zeros(0, np.uint64), np.zeros((0, TOP_K), np.int32), np.zeros((0, TOP_K), np.float32))
                continue
            h = _hash_windows(np.where(sep, 0, flat), n)[:-1]  # context ending before position i + n
            nxt = flat[n:]
            # a window is valid when neither its n tokens nor the next token is a separator
            bad = np.convolve(sep.astype(np.int64), np.ones(n, dtype=np.int64), "valid")[:-1] > 0
            ok = ~bad & (nxt >= 0)
            h, nxt = h[ok], nxt[ok]
            order = np.lexsort((nxt, h))
            h, nxt = h[order], nxt[order]
            # runs of equal (hash, next): count them
            new_pair = np.ones(len(h), dtype=bool)
            new_pair[1:] = (h[1:] != h[:-1]) | (nxt[1:] != nxt[:-1])
            starts = np.flatnonzero(new_pair)
            counts = np.diff(np.append(starts, len(h)))
            ph, pn = h[starts], nxt[starts]
            # per hash: total count and the pair with the largest count
            new_h = np.ones(len(ph), dtype=bool)
            new_h[1:] = ph[1:] != ph[:-1]
            hstarts = np.flatnonzero(new_h)
            totals = np.add.reduceat(counts, hstarts) if len(counts) else counts
            group = np.cumsum(new_h) - 1
            # each group's TOP_K pairs: sort by (group, -count, token), rank within the group
            order = np.lexsort((pn, -counts, group))
            g_sorted = group[order]
            rank = np.arange(len(order)) - hstarts[g_sorted]
            keep = rank < TOP_K
            sel, gi, ri = order[keep], g_sorted[keep], rank[keep]
            nxt_t = np.full((len(hstarts), TOP_K), -1, dtype=np.int32)
            share_t = np.zeros((len(hstarts), TOP_K), dtype=np.float32)
            nxt_t[gi, ri] = pn[sel]
            share_t[gi, ri] = counts[sel] / totals[gi]
            tables[n] = (ph[hstarts], nxt_t, share_t)
        return cls(tables, min_n, max_n, int((flat >= 0).sum()))

    # ------------------------------------------------------------------ files
    @staticmethod
    def save(path: str | Path, sequences: list[list[int]], min_n: int = 2, max_n: int = 6) -> None:
        """Write the corpus (the tables are rebuilt at load, in about a second per 100 k tokens)."""
        flat = np.concatenate([np.append(np.asarray(s, dtype=np.int32), -1) for s in sequences])
        np.savez_compressed(path, tokens=flat.astype(np.int32), min_n=min_n, max_n=max_n)

    @classmethod
    def load(cls, path: str | Path) -> SuffixDatastore:
        p = Path(path)
        try:
            with np.load(p) as f:
                flat, min_n, max_n = f["tokens"], int(f["min_n"]), int(f["max_n"])
        except FileNotFoundError:
            raise FileNotFoundError(f"{p}: no datastore here (write one with `tokenmill build-datastore`)") from None
        except (KeyError, ValueError, OSError) as e:
            raise ValueError(f"{p}: not a tokenmill datastore (.npz with tokens, min_n, max_n): {e}") from e
        if flat.ndim != 1 or not np.issubdtype(flat.dtype, np.integer):
            raise ValueError(f"{p}: tokens must be a 1-D integer array, got {flat.dtype} {flat.shape}")
        return cls.from_tokens(flat, min_n, max_n)

    # ---------------------------------------------------------------- lookups
    def next_token(self, context: Sequence[int], min_share: float = 0.0) -> int | None:
        """The most frequent continuation of the longest known suffix of context, or None."""
        found = self.next_tokens(context, min_share)
        return found[0][0] if found else None

    def next_tokens(self, context: Sequence[int], min_share: float = 0.0) -> list[tuple[int, float]]:
        """Up to TOP_K (token, share) continuations of the longest known suffix of context whose top share
        reaches min_share, most frequent first; [] if none."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            keys, nxt, share = self.tables[n]
            if not len(keys):
                continue
            h = _hash_one(context[-n:])
            i = int(np.searchsorted(keys, h))
            if i < len(keys) and keys[i] == h and share[i, 0] >= min_share:
                return [(int(t), float(sh)) for t, sh in zip(nxt[i], share[i]) if t >= 0]
        return []

    def draft(self, context: Sequence[int], k: int, min_share: float = 0.0) -> list[int]:
        """Up to k tokens, each the continuation of the context extended by the drafts before it."""
        return walk(self, context, k, min_share, self.max_n)


class Continuations(Protocol):
    """What the chain walk and the token tree ask of a datastore (SuffixDatastore; suffix.py's TenantView and
    Layered)."""

    def next_tokens(self, context: Sequence[int], min_share: float = 0.0) -> list[tuple[int, float]]: ...


def walk(store: Continuations, context: Sequence[int], k: int, min_share: float, window: int) -> list[int]:
    """Up to k tokens, each `store`'s most frequent continuation of the context extended by the drafts before it
    (the store looks at no more than the last `window` tokens)."""
    ctx = list(context[-window:])
    out: list[int] = []
    while len(out) < k:
        found = store.next_tokens(ctx, min_share)
        if not found:
            break
        out.append(found[0][0])
        ctx = (ctx + [found[0][0]])[-window:]
    return out
