"""An online suffix store: what the server wrote drafts for the requests that come after (vLLM's `suffix` method).

The offline datastore (datastore.py) is built once from the target's answers to public prompts and never
learns. Agents send the same kind of request again and again: the answers repeat whole passages (a JSON
skeleton, a tool call, a code template) that neither the new prompt nor the offline corpus holds. This store
takes every finished request's tokens (the last `max_n` of its prompt, then its output) and counts, for each
context of n tokens (min_n <= n <= max_n), the tokens that followed it:

    served: ... "name": "x", "id": 7 } ...        contexts of 2..max_n tokens -> {next token: count}
    later request ends with  "name": "y", "id"    longest known context  ", "id"  ->  ":" (count 1 of 1)

Lookups answer as SuffixDatastore.next_tokens does ((token, share) pairs of the longest context whose top
share reaches min_share), so the chain walk and the token tree (ngram.py) take either, or both layered
(`Layered`: this store first, then the offline one, which seeds it).

Tenants. Each `cache_salt` has a store of its own (requests without one share the anonymous store): a
tenant's text never drafts for another, as its KV blocks are never shared with another. Counters per tenant
(`stats`, live) let tests check it.

Memory bound. `max_tokens` bounds the tokens held over all tenants. Ingesting past it evicts whole sequences,
oldest first, and takes their counts back out, so the tables always describe exactly the sequences held.
Each held token costs up to (max_n - min_n + 1) dictionary entries: measured (tracemalloc) 0.9 KB per token at
max_n = 4 when every context is new (random tokens), so the default 65,536 tokens take at most ~59 MB.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.spec_decode.datastore import Continuations, walk

_MASK = (1 << 64) - 1
_MULT = 0x9E3779B97F4A7C15


def _context_key(ctx: Sequence[int]) -> int:
    """A 64-bit key of a context (a collision can only make a bad draft: the verifier still decides)."""
    h = 0
    for tok in ctx:
        h = (h * _MULT + int(tok) + 1) & _MASK
    return h


@dataclass
class TenantStats:
    """Counters of one tenant's store."""

    sequences_ingested: int = 0
    tokens_ingested: int = 0
    sequences_evicted: int = 0
    lookups: int = 0
    """Questions asked of this tenant's store (a match length, or the continuations of a context)."""
    hits: int = 0
    """Those that found something."""


@dataclass
class _Tenant:
    tables: dict[int, dict[int, dict[int, int]]]
    """n -> context key -> next token -> count."""
    stats: TenantStats
    tokens_held: int = 0


class OnlineSuffixStore:
    """Counts of the tokens that followed every 2..max_n-token context of the sequences served, per tenant,
    bounded to `max_tokens` held tokens in all (oldest sequences evicted first)."""

    def __init__(self, max_tokens: int = 65536, min_n: int = 2, max_n: int = 6) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.min_n = min_n
        self.max_n = max_n
        self._tenants: dict[str | None, _Tenant] = {}
        """Tenants with text ingested (their tables stay, empty, after eviction)."""
        self._stats: dict[str | None, TenantStats] = {}
        """Every tenant's counters, those that only asked included (a few dozen bytes each)."""
        self._held: deque[tuple[str | None, list[int]]] = deque()
        """The sequences held, oldest first, with their tenant."""
        self.tokens_held = 0

    # ------------------------------------------------------------------ writing
    def ingest(self, tenant: str | None, tokens: Sequence[int]) -> None:
        """Add one served sequence (the tail of its prompt and its output) to `tenant`'s store; evict the oldest
        sequences (any tenant's) while more than max_tokens are held. A sequence longer than the bound is cut
        to its last max_tokens tokens."""
        seq = [int(t) for t in tokens][-self.max_tokens :] if self.max_tokens else []
        if len(seq) <= self.min_n:
            return
        t = self._tenant(tenant)
        self._count(t, seq, +1)
        t.tokens_held += len(seq)
        t.stats.sequences_ingested += 1
        t.stats.tokens_ingested += len(seq)
        self._held.append((tenant, seq))
        self.tokens_held += len(seq)
        while self.tokens_held > self.max_tokens:
            old_tenant, old = self._held.popleft()
            ot = self._tenants[old_tenant]
            self._count(ot, old, -1)
            ot.tokens_held -= len(old)
            ot.stats.sequences_evicted += 1
            self.tokens_held -= len(old)

    def _tenant(self, tenant: str | None) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            tables: dict[int, dict[int, dict[int, int]]] = {n: {} for n in range(self.min_n, self.max_n + 1)}
            t = self._tenants[tenant] = _Tenant(tables, self.stats(tenant))
        return t

    def _count(self, t: _Tenant, seq: list[int], delta: int) -> None:
        for n in range(self.min_n, self.max_n + 1):
            table = t.tables[n]
            for i in range(n, len(seq)):
                key = _context_key(seq[i - n : i])
                nxt = table.get(key)
                if nxt is None:
                    nxt = table[key] = {}
                c = nxt.get(seq[i], 0) + delta
                if c > 0:
                    nxt[seq[i]] = c
                else:
                    nxt.pop(seq[i], None)
                    if not nxt:
                        del table[key]

    # ------------------------------------------------------------------ reading
    def next_tokens(
        self, tenant: str | None, context: Sequence[int], min_share: float = 0.0
    ) -> list[tuple[int, float]]:
        """Up to 3 (token, share) continuations of the longest suffix of `context` that `tenant`'s served text
        holds and whose top share reaches min_share, most frequent first; [] if none."""
        stats = self.stats(tenant)
        stats.lookups += 1
        t = self._tenants.get(tenant)
        if t is None:
            return []
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            nxt = t.tables[n].get(_context_key(context[len(context) - n :]))
            if not nxt:
                continue
            total = sum(nxt.values())
            ranked = sorted(nxt.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
            if ranked[0][1] / total >= min_share:
                stats.hits += 1
                return [(tok, c / total) for tok, c in ranked]
        return []

    def match_length(self, tenant: str | None, context: Sequence[int]) -> int:
        """The length of the longest suffix of `context` that `tenant`'s store holds a continuation of (0: none)."""
        stats = self.stats(tenant)
        stats.lookups += 1
        t = self._tenants.get(tenant)
        if t is None:
            return 0
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            if _context_key(context[len(context) - n :]) in t.tables[n]:
                stats.hits += 1
                return n
        return 0

    def stats(self, tenant: str | None) -> TenantStats:
        """The counters of `tenant` (live: they go on counting)."""
        st = self._stats.get(tenant)
        if st is None:
            st = self._stats[tenant] = TenantStats()
        return st

    def tenant_tokens_held(self, tenant: str | None) -> int:
        t = self._tenants.get(tenant)
        return 0 if t is None else t.tokens_held

    def view(self, tenant: str | None) -> TenantView:
        """One tenant's store as a datastore (next_tokens(context, min_share)), for the chain walk and the tree."""
        return TenantView(self, tenant)


@dataclass(frozen=True)
class TenantView:
    """A tenant's online store, answering as SuffixDatastore.next_tokens does."""

    store: OnlineSuffixStore
    tenant: str | None

    def next_tokens(self, context: Sequence[int], min_share: float = 0.0) -> list[tuple[int, float]]:
        return self.store.next_tokens(self.tenant, context, min_share)


@dataclass(frozen=True)
class Layered:
    """Datastores asked in order: the first with an answer gives it (the online store, then the offline seed)."""

    stores: tuple[Continuations, ...]

    def next_tokens(self, context: Sequence[int], min_share: float = 0.0) -> list[tuple[int, float]]:
        for s in self.stores:
            found = s.next_tokens(context, min_share)
            if found:
                return found
        return []

    def draft(self, context: Sequence[int], k: int, min_share: float = 0.0) -> list[int]:
        """Up to k tokens, each the first continuation of the context extended by the drafts before it."""
        return walk(self, context, k, min_share, max(len(context), 1) + k)
