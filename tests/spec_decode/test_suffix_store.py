"""The online suffix store (spec_decode/suffix.py): counts of what followed each context in served text, per tenant,
within a bound on the tokens held."""

from __future__ import annotations

import pytest

from tokenmill.spec_decode.datastore import SuffixDatastore
from tokenmill.spec_decode.suffix import Layered, OnlineSuffixStore


def test_longest_context_wins_and_shares_are_counts():
    s = OnlineSuffixStore(max_tokens=1000, min_n=2, max_n=4)
    s.ingest(None, [1, 2, 3, 4, 5])
    s.ingest(None, [9, 2, 3, 4, 6])
    s.ingest(None, [7, 3, 4, 6])
    # [2, 3, 4] -> 5 once, 6 once; [1, 2, 3, 4] -> 5 only: the 4-token context decides
    assert s.next_tokens(None, [1, 2, 3, 4]) == [(5, 1.0)]
    # [8, 2, 3, 4]: unknown; [2, 3, 4]: a tie, broken by the smaller token id
    assert s.next_tokens(None, [8, 2, 3, 4]) == [(5, 0.5), (6, 0.5)]
    # [0, 3, 4]: unknown, [3, 4] -> 6 twice, 5 once
    assert s.next_tokens(None, [0, 3, 4]) == [(6, 2 / 3), (5, 1 / 3)]
    assert s.next_tokens(None, [0, 3, 4], min_share=0.7) == []
    assert s.next_tokens(None, [0, 0]) == []


def test_tenants_never_see_each_others_text():
    s = OnlineSuffixStore(max_tokens=1000)
    s.ingest("alice", [10, 11, 12, 13, 14])
    assert s.next_tokens("alice", [11, 12]) == [(13, 1.0)]
    assert s.next_tokens("bob", [11, 12]) == []
    assert s.next_tokens(None, [11, 12]) == []
    assert s.stats("alice").hits == 1 and s.stats("bob").hits == 0
    assert s.tenant_tokens_held("alice") == 5 and s.tenant_tokens_held("bob") == 0


def test_bound_evicts_oldest_sequences_and_their_counts():
    s = OnlineSuffixStore(max_tokens=10, min_n=2, max_n=3)
    s.ingest("a", [1, 2, 3, 4])
    s.ingest("b", [5, 6, 7, 8])
    assert s.tokens_held == 8
    s.ingest("a", [1, 2, 9, 9])  # 12 > 10: the oldest sequence (a's first) goes, and with it [1, 2] -> 3
    assert s.tokens_held == 8 and s.tenant_tokens_held("a") == 4 and s.tenant_tokens_held("b") == 4
    assert s.next_tokens("a", [1, 2]) == [(9, 1.0)]
    assert s.stats("a").sequences_evicted == 1
    # every count removed with its sequence: the tables hold only what the held sequences give
    for _ in range(50):
        s.ingest("b", [5, 6, 7, 8])
    assert s.tokens_held <= 10 and s.tenant_tokens_held("a") == 0
    assert all(not table for table in s._tenants["a"].tables.values())
    assert s.next_tokens("b", [5, 6]) == [(7, 1.0)]


def test_sequence_longer_than_the_bound_keeps_its_tail():
    s = OnlineSuffixStore(max_tokens=4, min_n=2, max_n=2)
    s.ingest(None, [1, 2, 3, 4, 5, 6])
    assert s.tokens_held == 4
    assert s.next_tokens(None, [1, 2]) == [] and s.next_tokens(None, [4, 5]) == [(6, 1.0)]


def test_layered_asks_the_online_store_first_then_the_seed():
    seed = SuffixDatastore.build([[1, 2, 3, 4], [5, 6, 7]], min_n=2, max_n=3)
    s = OnlineSuffixStore(max_tokens=100)
    s.ingest("t", [1, 2, 9, 9])
    both = Layered((s.view("t"), seed))
    assert both.next_tokens([1, 2]) == [(9, 1.0)]  # the tenant's own text first
    assert both.next_tokens([5, 6]) == [(7, 1.0)]  # the seed where the tenant has nothing
    assert Layered((s.view("other"), seed)).next_tokens([1, 2]) == [(3, 1.0)]
    assert both.draft([5, 6], 3) == [7]


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        OnlineSuffixStore(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="max_tokens"):
        OnlineSuffixStore(max_tokens=-1)
