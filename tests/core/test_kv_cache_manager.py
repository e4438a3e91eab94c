"""Block pool + KV cache manager: exact block ids and orders for prefix hits, eviction, salts,
sharing and copy-on-write."""

from __future__ import annotations

import pytest

from tokenmill.core.block_hash import hash_block
from tokenmill.core.kv_cache_manager import BlockCopy, KVCacheManager
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), eos_token_id=None, max_tokens=8, cache_salt=salt)


def make_kv_manager(num_blocks: int = 10, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching=caching)


def admit(kv: KVCacheManager, req: Request) -> list[int]:
    """What the scheduler does for a waiting request: look up the prefix, allocate the rest."""
    computed = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - computed.num_tokens, computed) is not None
    req.num_computed_tokens = req.num_tokens
    return kv.get_block_ids(req.request_id)


def finish(kv: KVCacheManager, req: Request) -> None:
    from tokenmill.request import RequestStatus

    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)


def free_order(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


def test_miss_then_full_hit_recomputes_last_token():
    kv = make_kv_manager()
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == [0, 1, 2]
    assert kv.stats.queries == 10 and kv.stats.hits == 0
    finish(kv, a)
    # tail first: a's last block is evicted first, its first block last
    assert free_order(kv) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    b = make_request("b", list(range(10)))
    computed = kv.get_computed_blocks(b)
    # full blocks 0, 1 and a's tail (block 2 holds token 8): everything but the last token
    assert [x.block_id for x in computed.blocks] == [0, 1] and computed.num_tokens == 9
    assert computed.tail is not None and computed.tail == (kv.pool.blocks[2], 1)
    assert admit(kv, b) == [0, 1, 3]
    assert kv.take_block_copies() == [BlockCopy(2, 3)]  # the tail is copied, never written
    assert kv.stats.hits == 9
    assert kv.pool.blocks[2].block_hash is not None  # still cached
    kv.check_integrity()


def test_prompt_of_whole_blocks_copies_its_last_block():
    kv = make_kv_manager()
    a = make_request("a", list(range(8)))
    admit(kv, a)
    finish(kv, a)
    b = make_request("b", list(range(8)))
    # 2 full blocks cached, but the last token must be recomputed: block 0 is served, block 1 is copied for the
    # 3 tokens before the last
    computed = kv.get_computed_blocks(b)
    assert [x.block_id for x in computed.blocks] == [0] and computed.tail == (kv.pool.blocks[1], 3)
    assert computed.num_tokens == 7
    assert admit(kv, b) == [0, 2]
    assert kv.take_block_copies() == [BlockCopy(1, 2)]
    kv.check_integrity()


def test_a_tail_serves_the_next_turn_and_stays_cached():
    """A conversation's next turn extends the last one: its tokens in a's partly filled block are copied."""
    kv = make_kv_manager()
    a = make_request("a", list(range(10)))
    admit(kv, a)
    finish(kv, a)
    b = make_request("b", list(range(10)) + [10, 11])
    computed = kv.get_computed_blocks(b)
    assert computed.num_tokens == 10 and computed.tail == (kv.pool.blocks[2], 2)
    assert admit(kv, b) == [0, 1, 3]
    assert kv.take_block_copies() == [BlockCopy(2, 3)]
    c = make_request("c", list(range(9)) + [77, 78])  # shares one of the tail's two tokens
    assert kv.get_computed_blocks(c).tail == (kv.pool.blocks[2], 1)
    kv.check_integrity()


def test_sibling_tails_the_longest_common_prefix_wins():
    """Beams: requests that share 8 tokens and end in different partial blocks; each later request takes the
    tail that shares the most tokens with it."""
    kv = make_kv_manager(12)
    x = make_request("x", list(range(8)) + [8, 9, 20])
    y = make_request("y", list(range(8)) + [8, 30])
    assert admit(kv, x) == [0, 1, 2]
    assert admit(kv, y) == [0, 1, 3]
    finish(kv, x)
    finish(kv, y)
    assert kv.get_computed_blocks(make_request("p", list(range(8)) + [8, 9, 20, 21])).tail == (kv.pool.blocks[2], 3)
    assert kv.get_computed_blocks(make_request("q", list(range(8)) + [8, 30, 31])).tail == (kv.pool.blocks[3], 2)
    assert kv.get_computed_blocks(make_request("r", list(range(8)) + [8, 9, 55])).tail == (kv.pool.blocks[2], 2)
    assert kv.get_computed_blocks(make_request("s", list(range(8)) + [5, 6])).tail is None
    salted = make_request("t", list(range(8)) + [8, 9, 20, 21], salt="other")
    assert kv.get_computed_blocks(salted).num_tokens == 0  # another tenant sees neither blocks nor tails
    kv.check_integrity()


def test_a_tail_is_cached_only_when_its_last_holder_frees_it():
    """n > 1 / forks share a partly filled block; the holder that stays writes into it in place, so the block
    becomes a tail only when the last holder frees it, with that holder's tokens."""
    kv = make_kv_manager()
    a = make_request("a", list(range(6)))
    admit(kv, a)
    b = make_request("b", list(range(6)))
    kv.fork(a, b, 6)  # b holds [0, 1] too (block 1: tokens 4, 5)
    b.num_computed_tokens = 6
    finish(kv, a)
    assert kv.pool.blocks[1].block_hash is None  # b still holds it (and may write into it)
    b.append_output_token(42)
    assert kv.allocate_slots(b, 1) == []  # b writes position 6 in place: it is the only holder now
    b.num_computed_tokens = 7
    finish(kv, b)
    got = kv.get_computed_blocks(make_request("c", list(range(6)) + [42, 43]))
    assert got.tail == (kv.pool.blocks[1], 3) and got.num_tokens == 7
    kv.check_integrity()


def test_an_evicted_tail_is_found_no_more():
    kv = make_kv_manager(num_blocks=4)
    a = make_request("a", list(range(6)))  # blocks 0, 1 (tail: tokens 4, 5)
    admit(kv, a)
    finish(kv, a)
    assert free_order(kv) == [2, 3, 1, 0]
    c = make_request("c", [100 + i for i in range(10)])  # takes 2, 3 and the tail's block 1
    assert admit(kv, c) == [2, 3, 1]
    assert kv.get_computed_blocks(make_request("d", list(range(6)) + [9])).tail is None
    assert not kv.pool.tails
    kv.check_integrity()


def test_partial_hit_and_miss():
    kv = make_kv_manager()
    a = make_request("a", list(range(12)))
    admit(kv, a)
    b = make_request("b", [0, 1, 2, 3, 4, 5, 99, 7, 8])  # diverges in block 1
    assert [x.block_id for x in kv.get_computed_blocks(b).blocks] == [0]
    c = make_request("c", [50, 1, 2, 3, 4, 5, 6, 7, 8])  # diverges in block 0
    assert kv.get_computed_blocks(c).blocks == []
    assert admit(kv, b) == [0, 3, 4]
    assert kv.pool.blocks[0].ref_cnt == 2
    kv.check_integrity()


def test_lru_eviction_order():
    kv = make_kv_manager(num_blocks=6)
    a = make_request("a", list(range(9)))  # blocks [0, 1, 2]; 0 and 1 cached
    admit(kv, a)
    finish(kv, a)
    assert free_order(kv) == [3, 4, 5, 2, 1, 0]
    c = make_request("c", [100 + i for i in range(17)])  # 5 blocks, no hit: takes 3, 4, 5, 2, 1
    assert admit(kv, c) == [3, 4, 5, 2, 1]
    assert kv.pool.num_evictions == 2  # block 2 (a's tail) and block 1 (a's 2nd block) evicted, block 0 kept
    h0 = hash_block(None, [0, 1, 2, 3])
    assert kv.pool.cached.get(h0) is kv.pool.blocks[0]
    assert hash_block(h0, [4, 5, 6, 7]) not in kv.pool.cached
    d = make_request("d", list(range(9)))
    assert [x.block_id for x in kv.get_computed_blocks(d).blocks] == [0]
    kv.check_integrity()


def test_touched_cached_free_block_moves_to_back():
    kv = make_kv_manager(num_blocks=6)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    finish(kv, a)
    assert free_order(kv) == [3, 4, 5, 2, 1, 0]
    b = make_request("b", [0, 1, 2, 3, 70, 71])  # hits block 0: taken out of the free queue
    assert admit(kv, b) == [0, 3]
    assert free_order(kv) == [4, 5, 2, 1]
    finish(kv, b)  # tail first: 3 then 0 go to the back
    assert free_order(kv) == [4, 5, 2, 1, 3, 0]
    kv.check_integrity()


def test_cache_salt_isolates_tenants():
    kv = make_kv_manager()
    a = make_request("a", list(range(9)), salt="tenant-1")
    admit(kv, a)
    assert kv.get_computed_blocks(make_request("b", list(range(9)), salt="tenant-2")).blocks == []
    assert kv.get_computed_blocks(make_request("c", list(range(9)))).blocks == []
    hit = kv.get_computed_blocks(make_request("d", list(range(9)), salt="tenant-1"))
    assert [x.block_id for x in hit.blocks] == [0, 1]


def test_refcounts_under_sharing():
    kv = make_kv_manager()
    reqs = [make_request(f"r{i}", list(range(9)) + [20 + i]) for i in range(3)]
    assert admit(kv, reqs[0]) == [0, 1, 2]
    assert admit(kv, reqs[1]) == [0, 1, 3]
    assert admit(kv, reqs[2]) == [0, 1, 4]
    kv.pool.check_integrity({0: 3, 1: 3, 2: 1, 3: 1, 4: 1})
    mem = kv.memory_usage({r.request_id: r.num_tokens for r in reqs})
    assert (mem.num_blocks_used, mem.num_blocks_shared, mem.num_allocated_slots, mem.num_filled_slots) == (5, 2, 20, 14)
    finish(kv, reqs[1])
    kv.pool.check_integrity({0: 2, 1: 2, 2: 1, 4: 1})
    assert free_order(kv)[-1] == 3


def test_fork_and_copy_on_write_of_partial_block():
    kv = make_kv_manager()
    a = make_request("a", list(range(6)))  # blocks [0, 1]; block 1 holds 2 of 4 tokens
    assert admit(kv, a) == [0, 1]
    b = make_request("b", list(range(6)))
    kv.fork(a, b, num_shared_tokens=6)
    b.num_computed_tokens = 6
    kv.pool.check_integrity({0: 2, 1: 2})
    assert kv.get_block_ids("b") == [0, 1]
    # b writes position 6 into shared block 1: it gets a fresh block with a copy of slots 4..5
    b.append_output_token(40)
    assert kv.allocate_slots(b, 1) is not None
    assert kv.get_block_ids("b") == [0, 2]
    assert kv.take_block_copies() == [BlockCopy(1, 2)]
    kv.pool.check_integrity({0: 2, 1: 1, 2: 1})
    # a is now the only holder of block 1: it writes in place, no copy
    a.append_output_token(41)
    assert kv.allocate_slots(a, 1) is not None
    assert kv.get_block_ids("a") == [0, 1] and kv.take_block_copies() == []
    kv.check_integrity()


def test_fork_at_block_boundary_needs_no_copy():
    kv = make_kv_manager()
    a = make_request("a", list(range(8)))  # two full blocks
    admit(kv, a)
    b = make_request("b", list(range(8)))
    kv.fork(a, b, 8)
    b.num_computed_tokens = 8
    b.append_output_token(5)
    kv.allocate_slots(b, 1)
    assert kv.get_block_ids("b") == [0, 1, 2] and kv.take_block_copies() == []
    kv.pool.check_integrity({0: 2, 1: 2, 2: 1})


def test_failed_allocation_changes_nothing_and_counts_no_stats():
    kv = make_kv_manager(num_blocks=2)
    a = make_request("a", list(range(12)))  # needs 3 blocks
    computed = kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 12, computed) is None
    assert kv.stats.queries == 0 and kv.stats.hits == 0
    assert free_order(kv) == [0, 1] and "a" not in kv.req_blocks


def test_copy_on_write_fails_cleanly_when_pool_is_full():
    kv = make_kv_manager(num_blocks=2)
    a = make_request("a", list(range(6)))
    admit(kv, a)
    b = make_request("b", list(range(6)))
    kv.fork(a, b, 6)
    b.num_computed_tokens = 6
    b.append_output_token(1)
    assert kv.allocate_slots(b, 1) is None  # the copy needs a free block
    kv.pool.check_integrity({0: 2, 1: 2})
    assert kv.take_block_copies() == []


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_off_never_hits(caching):
    kv = make_kv_manager(caching=caching)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    n = len(kv.get_computed_blocks(make_request("b", list(range(9)))).blocks)
    assert n == (2 if caching else 0)


def test_block_map_names_every_block_and_its_holders():
    from tokenmill.core.kv_cache_manager import BlockMap

    kv = make_kv_manager(6)
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == [0, 1, 2]
    finish(kv, a)  # its two full blocks stay cached, and the partial one as a tail
    assert kv.block_map() == BlockMap("ccc...", {})
    b = make_request("b", list(range(8)) + [50, 51])
    assert admit(kv, b) == [0, 1, 3]
    c = make_request("c", list(range(4)) + [60, 61])
    assert admit(kv, c) == [0, 4]
    assert kv.block_map() == BlockMap("sucuu.", {"b": [0, 1, 3], "c": [0, 4]})
    finish(kv, c)
    kv.hold(b, "t1")  # a finished prefill's blocks kept for a decode worker
    assert kv.block_map() == BlockMap("hhchc.", {"t1": [0, 1, 3]})
