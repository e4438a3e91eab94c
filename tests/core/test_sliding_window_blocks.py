"""KV-cache groups with sliding windows (core/kv_cache_manager.py): exact block ids as a window slides, prefix
hits that must hold the window's blocks, memory accounting per kind of group, forks and frees."""

from __future__ import annotations

from tokenmill.config import KVCacheGroup, plan_kv_groups
from tokenmill.core.kv_cache_manager import NULL_BLOCK, NULL_BLOCK_ID, KVCacheManager
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

BS = 4
W = 8  # a query at p sees keys p - 7 .. p
GROUPS = [KVCacheGroup((0,), None), KVCacheGroup((1,), W)]


def req(rid: str, n: int, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=64), eos_token_id=None, max_tokens=64)


def run_prompt(kv: KVCacheManager, r: Request, chunk: int) -> None:
    """Admit r and compute its prompt in chunks, as the scheduler does."""
    computed = kv.get_computed_blocks(r)
    n = min(chunk, r.num_tokens - computed.num_tokens)
    assert kv.allocate_slots(r, n, computed) is not None
    r.num_computed_tokens = computed.num_tokens + n
    while r.num_computed_tokens < r.num_tokens:
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        assert kv.allocate_slots(r, n) is not None
        r.num_computed_tokens += n


def test_plan_groups_gemma3_270m():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = plan_kv_groups(windows)
    assert [g.layers for g in groups] == [(5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert [g.sliding_window for g in groups] == [None] + [512] * 5
    assert plan_kv_groups([None] * 4) == [KVCacheGroup((0, 1, 2, 3), None)]


def test_window_returns_blocks_as_it_slides():
    kv = KVCacheManager(12, BS, enable_caching=False, groups=GROUPS)
    a = req("a", 14)
    run_prompt(kv, a, chunk=6)  # chunks [0, 6) [6, 12) [12, 14); each step: global blocks first, then window
    # before the third chunk (12 computed) the query at 12 sees keys 5.., so the window's block 2 (keys 0..3)
    # went back to the pool (to its end: blocks 8.. are handed out first)
    assert kv.get_group_block_ids("a") == [[0, 1, 4, 6], [NULL_BLOCK_ID, 3, 5, 7]]
    assert kv.tables["a"][1][0] is NULL_BLOCK and [b.block_id for b in kv.pool.free_queue] == [8, 9, 10, 11, 2]
    assert kv.num_blocks_slid_out == 1
    a.num_computed_tokens = 14
    assert kv.allocate_slots(a, 1) is not None  # decode at 14: sees keys 7..14, block 3 (keys 4..7) stays
    assert kv.num_blocks_slid_out == 1
    a.num_computed_tokens = 15
    assert kv.allocate_slots(a, 1) is not None  # decode at 15: sees 8..15, block 3 goes back
    assert kv.num_blocks_slid_out == 2
    a.num_computed_tokens = 16
    assert kv.allocate_slots(a, 1) is not None  # decode at 16: a fifth block in each group
    a.num_computed_tokens = 17
    assert kv.get_group_block_ids("a") == [[0, 1, 4, 6, 8], [NULL_BLOCK_ID, NULL_BLOCK_ID, 5, 7, 9]]
    mem = kv.memory_usage({"a": a.num_computed_tokens})
    assert mem.num_blocks_used_by_kind == {"global": 5, "window 8": 3}
    assert mem.num_blocks_used == 8 and mem.num_blocks_free == 4
    kv.check_integrity()
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    assert kv.pool.num_free_blocks == 12
    kv.check_integrity()


def test_prefix_hit_needs_the_windows_blocks():
    kv = KVCacheManager(16, BS, enable_caching=True, groups=GROUPS)
    a = req("a", 17)
    run_prompt(kv, a, chunk=4)  # every full block cached in both groups as it filled
    a.status = RequestStatus.FINISHED_STOPPED
    # b shares a's first 16 tokens: the global group hits 4 blocks; the query at 16 needs window keys 9..15
    # (blocks 2 and 3) - cached, though blocks 0 and 1 of the window slid out and were freed earlier
    tables = kv.tables["a"]
    kv.free(a)
    b = req("b", 20)
    computed = kv.get_computed_blocks(b)
    assert computed.num_tokens == 16
    assert computed.blocks == tables[0][:4]
    assert computed.group_blocks == [[NULL_BLOCK, NULL_BLOCK, tables[1][2], tables[1][3]]]
    # the window's block 3 evicted: no hit at 16 (its query needs keys 9..15); at 12 the query needs the
    # window's blocks 1 and 2 (keys 5..11), cached still though block 1 slid out: the hit shrinks to 12
    kv.pool.evict(tables[1][3])
    computed = kv.get_computed_blocks(b)
    assert computed.num_tokens == 12 and computed.blocks == tables[0][:3]
    slid_out_block1 = kv.pool.cached[(1, kv.block_hashes(b)[1])]  # a's table lost it; the cache did not
    assert computed.group_blocks == [[NULL_BLOCK, slid_out_block1, tables[1][2]]]
    assert kv.allocate_slots(b, 8, computed) is not None
    assert kv.tables["b"][1][:3] == [NULL_BLOCK, slid_out_block1, tables[1][2]]
    kv.check_integrity()


def test_fork_shares_both_groups():
    kv = KVCacheManager(12, BS, enable_caching=False, groups=GROUPS)
    a = req("a", 10)
    run_prompt(kv, a, chunk=10)
    b = req("b", 10)
    kv.fork(a, b, 10)
    assert kv.get_group_block_ids("b") == kv.get_group_block_ids("a")
    assert all(blk.ref_cnt == 2 for t in kv.tables["a"] for blk in t)
    # b writes at position 10 of its shared partial block 2 in both groups: copy on write in each
    b.num_computed_tokens = 10
    assert kv.allocate_slots(b, 1) is not None
    copies = kv.take_block_copies()
    assert len(copies) == 2 and "b" in kv.take_rewritten()
    kv.check_integrity()


def test_min_blocks_for_counts_the_window_once():
    kv = KVCacheManager(100, 16, groups=plan_kv_groups([None if (i + 1) % 6 == 0 else 512 for i in range(18)]))
    # 4,000 tokens: the global group 250 blocks; each of 5 window groups at least 32 + 1
    assert kv.min_blocks_for(4000) == 250 + 5 * 33
    assert KVCacheManager(100, 16).min_blocks_for(4000) == 250
