"""Per-request block tables on top of the block pool, with prefix-cache lookups.

A request's blocks cover positions [0, num_blocks * block_size). Full blocks that hold only
real tokens (never draft tokens) are hashed and registered in the prefix cache as soon as
they are allocated: within one step every layer writes all new K/V before any attention
reads, so a request scheduled in the same step may already hit them.

Sharing and copy-on-write. Several requests may hold the same physical block (prefix-cache
hits, the n samples of one prompt, beams): its ref_cnt counts the holders. Only the block a
request is about to write into can need a copy: a full shared block is never written again,
and a partly filled one is shared only after a fork. Before a request writes into a block
that others also hold, `allocate_slots` gives it a fresh block and queues (src, dst) in
`pending_copies`; the runner copies those K/V (all layers) before the step's forward.

    fork:   A [b7 b2(3/4 filled)]   B = A's table   b7.ref = b2.ref = 2
    B decodes position 3 -> b2 is shared: B gets b9, copy (2 -> 9), b2.ref = 1
            A [b7 b2]   B [b7 b9]   (A then writes into b2 in place)

Tails. When the last holder of a request's partly filled last block frees it, the block stays in the
prefix cache as a tail, keyed by the hash of the full block before it and the tokens it holds. A later
request whose full-block hit ends there takes the tail with the longest common prefix: the tail's K/V
are copied into the request's own block (the tail stays cached, unwritten), and the hit grows by that
prefix. Beam search, which resubmits each beam as a new request one token longer, then computes one
token per beam and round, and a chat's next turn does not recompute the end of the last one.

    A (10 tokens) freed: [b0 b1 | b2: 8 9 . .] -> b0, b1 cached by hash, b2 cached as tail (hash(b1), (8, 9))
    B = A's tokens + [10, 11]: full hits b0 b1, tail b2 with 2 tokens -> B [b0 b1 b5], copy (2 -> 5),
        10 tokens computed, tokens 10 and 11 to compute

One-group models only (a window's tails would need every group's).

KV-cache groups (models with sliding-window layers, Gemma 3). The layers are split into groups of
equal size, each of one kind (global, or a window of W tokens); every group has its own block table,
and a block of the one pool holds one group's layers (the runner's group_size cache tensors: layer i
of a group lives in tensor i). A windowed group drops the blocks no later query can see: a query at
position p sees keys (p - W, p], so once the request has computed c tokens every block ending at or
before c - W + 1 goes back to the pool and its table entry becomes NULL_BLOCK.

    W 8, block_size 4, 14 tokens computed: the next query (position 14) sees keys 7..14
    global group   [b0 b1 b2 b3]
    window group   [ -  b5 b6 b7]      b4 (keys 0..3) returned to the pool: ends before key 7

A prefix hit must hold, in every windowed group, the blocks the next query sees; the hit is the
longest prefix of cached global blocks for which it does (`get_computed_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.config import KVCacheGroup
from tokenmill.core.block_hash import BlockHash, BlockKey, TailKey, extend_block_hashes
from tokenmill.core.block_pool import BlockPool, KVCacheBlock, TailHit
from tokenmill.core.step_io import BlockCopy
from tokenmill.request import Request

NULL_BLOCK = KVCacheBlock(-1)
"""A windowed group's table entry for a block that slid out of the window (never read, never written)."""
NULL_BLOCK_ID = 0
"""What the runner is sent for a NULL_BLOCK entry: any valid id does, the attention never reads it."""


@dataclass
class ComputedBlocks:
    blocks: list[KVCacheBlock]
    """Group 0's hits (the only group of a one-group model)."""
    num_tokens: int
    group_blocks: list[list[KVCacheBlock]] = field(default_factory=list)
    """Groups 1.. : their hits over the same blocks (NULL_BLOCK where a window no longer needs one)."""
    tail: TailHit | None = None
    """A cached tail continuing the full blocks (its tokens are counted in num_tokens): copied into the request's
    own next block when it is admitted."""

    def per_group(self) -> list[list[KVCacheBlock]]:
        return [self.blocks, *self.group_blocks]


@dataclass
class PrefixCacheStats:
    queries: int = 0
    """Prompt tokens looked up."""
    hits: int = 0
    """Prompt tokens found cached."""


@dataclass
class KVMemoryUsage:
    """Physical occupancy of the block pool. num_blocks_used + num_blocks_free = num_blocks_total;
    cached-but-free blocks are free (allocatable) but still serve prefix hits until evicted."""

    num_blocks_total: int
    num_blocks_used: int
    """Blocks referenced by at least one request."""
    num_blocks_free: int
    """Blocks that can be allocated now (never used, evicted, or cached but unreferenced)."""
    num_blocks_cached_free: int
    """Free blocks still holding a prefix-cache entry."""
    num_blocks_shared: int
    """Used blocks referenced by more than one request (prefix hits, forks, beams)."""
    num_allocated_slots: int
    """num_blocks_used * block_size."""
    num_filled_slots: int
    """Distinct physical slots holding a computed token (a shared slot counts once)."""
    num_blocks_used_by_kind: dict[str, int] = field(default_factory=dict)
    """Used blocks per kind of group: "global", and "window W" for windowed groups (a shared block counts once)."""

    @property
    def num_unfilled_slots(self) -> int:
        """Slots allocated but not holding a token (internal fragmentation)."""
        return self.num_allocated_slots - self.num_filled_slots


BLOCK_FREE, BLOCK_CACHED, BLOCK_USED, BLOCK_SHARED, BLOCK_HELD = ".", "c", "u", "s", "h"
"""BlockMap.states letters: free (never used or evicted), cached-but-free (unreferenced, still a prefix-cache
entry), used by one request, shared by several (prefix hits, n > 1 samples, beams), held for a decode worker."""


@dataclass(frozen=True)
class BlockMap:
    """Every block of the pool at one moment, for a picture of it (the dashboard's grid).

    pool of 6, A holds [0 1], B hit A's first block and holds [0 2], block 4 was freed but is cached:
    states = "sucu.."   owners = {"A": [0, 1], "B": [0, 2]}
    """

    states: str
    """One letter per block id (BLOCK_FREE, BLOCK_CACHED, BLOCK_USED, BLOCK_SHARED, BLOCK_HELD)."""
    owners: dict[str, list[int]]
    """Request id -> its block table (block ids in position order); held transfers under their transfer id."""


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        groups: Sequence[KVCacheGroup] | None = None,
    ) -> None:
        """groups: the model's KV-cache groups (plan_kv_groups); None: one global group."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.groups: list[KVCacheGroup] = list(groups) if groups else [KVCacheGroup((), None)]
        self.tables: dict[str, list[list[KVCacheBlock]]] = {}
        """Request id -> one block table per group (in position order; NULL_BLOCK where a window slid past)."""
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached: dict[str, int] = {}
        """Blocks of each request already registered in the prefix cache."""
        self.stats = PrefixCacheStats()
        self.pending_copies: list[BlockCopy] = []
        """Copy-on-write copies queued since the last `take_block_copies`, in order."""
        self.held: dict[str, list[KVCacheBlock]] = {}
        """Blocks of finished requests kept for a decode worker to pull (disaggregation), by transfer id."""
        self.rewritten: set[str] = set()
        """Requests whose block table changed other than by appending (copy on write) since
        take_rewritten(); every other table only grows. (A window's slid-out entries are not a rewrite: the
        runner's old ids there are never read.)"""
        self.num_blocks_slid_out = 0
        """Blocks windowed groups gave back because no later query could see them."""

    @property
    def req_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Request id -> group 0's table (every layer's, for a one-group model)."""
        return {rid: t[0] for rid, t in self.tables.items()}

    def _key(self, g: int, h: BlockHash) -> BlockKey:
        """Prefix-cache key of a block of group g: the same tokens are different K/V in another group."""
        return h if g == 0 else (g, h)

    # ------------------------------------------------------------------ lookups
    def block_hashes(self, req: Request) -> list[BlockHash]:
        hashes = self.req_hashes.setdefault(req.request_id, [])
        extend_block_hashes(hashes, req.all_token_ids, self.block_size, req.cache_salt)
        return hashes

    def first_needed_block(self, g: int, num_computed: int) -> int:
        """Group g's first block a query at position num_computed (or later) can see."""
        w = self.groups[g].sliding_window
        return 0 if w is None else max(0, num_computed - w + 1) // self.block_size

    def get_computed_blocks(self, req: Request, tails: bool = True) -> ComputedBlocks:
        """Longest run of cached full blocks at the start of the request's tokens (in every windowed group:
        the blocks the next query sees), then (one-group models, `tails`) a cached block that continues it: the
        full block holding the last token, or the tail sharing the most tokens. The last token is never served
        from cache: its logits are needed.
        Pure lookup: stats are counted by `allocate_slots` once the request is actually admitted."""
        if not self.enable_caching:
            return ComputedBlocks([], 0, [[] for _ in self.groups[1:]])
        hashes = self.block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        get = self.pool.get_cached_block
        n = max_blocks
        for g, grp in enumerate(self.groups):
            if grp.sliding_window is None:
                for j in range(n):
                    if get(self._key(g, hashes[j])) is None:
                        n = j
                        break
        windowed = [g for g, grp in enumerate(self.groups) if grp.sliding_window is not None]
        while n > 0 and windowed:  # the hit must hold every window's blocks for the query at n * block_size
            missing = [
                j
                for g in windowed
                for j in range(self.first_needed_block(g, n * self.block_size), n)
                if get(self._key(g, hashes[j])) is None
            ]
            if not missing:
                break
            n = max(missing)
        per_group: list[list[KVCacheBlock]] = []
        for g in range(len(self.groups)):
            first = self.first_needed_block(g, n * self.block_size)
            hits = [NULL_BLOCK] * first
            for j in range(first, n):
                b = get(self._key(g, hashes[j]))
                assert b is not None, "n was cut back until every group holds its blocks first..n-1"
                hits.append(b)
            per_group.append(hits)
        tail = None
        start = n * self.block_size
        if tails and len(self.groups) == 1 and req.num_tokens - 1 > start:
            if req.num_tokens == start + self.block_size:  # block n is full but holds the last token: its cached
                b = get(hashes[n])  # copy serves the others
                tail = None if b is None else TailHit(b, self.block_size - 1)
            if tail is None:
                end = min(req.num_tokens - 1, start + self.block_size - 1)
                parent = hashes[n - 1] if n else None
                tail = self.pool.longest_tail(parent, req.cache_salt, req.all_token_ids[start:end])
        return ComputedBlocks(per_group[0], start + (tail.num_tokens if tail else 0), per_group[1:], tail)

    # --------------------------------------------------------------- allocation
    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's table as block ids (NULL_BLOCK_ID for slid-out entries)."""
        return self.get_group_block_ids(request_id)[0]

    def get_group_block_ids(self, request_id: str, first_group: int = 0) -> list[list[int]]:
        """The tables of groups first_group.. as block ids (NULL_BLOCK_ID for slid-out entries)."""
        tables = self.tables.get(request_id)
        if tables is None:
            return [[] for _ in self.groups[first_group:]]
        return [[NULL_BLOCK_ID if b is NULL_BLOCK else b.block_id for b in t] for t in tables[first_group:]]

    def _slide_out(self, tables: list[list[KVCacheBlock]], num_computed: int) -> None:
        """Windowed groups: entries no query from num_computed on can see go back to the pool."""
        for g, t in enumerate(tables):
            first = min(self.first_needed_block(g, num_computed), len(t))
            gone = [b for b in t[:first] if b is not NULL_BLOCK]
            if gone:
                for j in range(first):
                    t[j] = NULL_BLOCK
                self.pool.free_blocks(gone)
                self.num_blocks_slid_out += len(gone)

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: ComputedBlocks | None = None, cache_blocks: bool = True
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens after the computed ones (and after the
        cache hits in `computed`), in every group. Returns the newly allocated blocks, or None if the pool
        cannot supply them (nothing changes then, except that windowed groups may have returned blocks no
        query will read again). cache_blocks=False: do not register the new full blocks in the prefix cache
        yet (their K/V arrive later, by a transfer: `cache_blocks`)."""
        created = req.request_id not in self.tables
        tables = self.tables.setdefault(req.request_id, [[] for _ in self.groups])
        hits = computed.per_group() if computed else [[] for _ in self.groups]
        num_computed = req.num_computed_tokens + (computed.num_tokens if computed else 0)
        total = num_computed + num_new_tokens
        num_required = -(-total // self.block_size)
        if computed is None:  # a running request (an admitted one's hits already leave slid-out entries NULL)
            self._slide_out(tables, num_computed)
        num_new = [max(0, num_required - len(t) - len(h)) for t, h in zip(tables, hits)]
        # Blocks this step writes into that other requests also hold: copy on write.
        cow = [[j for j in range(num_computed // self.block_size, len(t)) if t[j].ref_cnt > 1] for t in tables]
        # Hits sitting in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for h in hits for b in h if b is not NULL_BLOCK and b.ref_cnt == 0)
        if sum(num_new) + sum(map(len, cow)) > self.pool.num_free_blocks - num_evictable_hits:
            if created:
                del self.tables[req.request_id]
            return None
        if computed is not None:
            self.stats.queries += req.num_tokens
            self.stats.hits += computed.num_tokens
        out: list[KVCacheBlock] = []
        for g, (t, h, n, cw) in enumerate(zip(tables, hits, num_new, cow)):
            self.pool.touch([b for b in h if b is not NULL_BLOCK])
            t.extend(h)
            new = self.pool.get_new_blocks(n + len(cw))
            if g == 0 and computed is not None and computed.tail is not None:
                # the tail's K/V into the request's own block (it follows the hits); src == dst if this very
                # allocation reused the tail's block: its K/V are still in place
                assert n > 0 and len(t) * self.block_size < num_computed, "the tail's tokens need a block"
                if new[0] is not computed.tail.block:
                    self.pending_copies.append(BlockCopy(computed.tail.block.block_id, new[0].block_id))
            for j, dst in zip(cw, new[n:]):
                src = t[j]
                if j * self.block_size < num_computed:  # holds computed tokens: copy them
                    self.pending_copies.append(BlockCopy(src.block_id, dst.block_id))
                self.pool.free_blocks([src])  # still held by the others
                t[j] = dst
            t.extend(new[:n])
            out.extend(new)
        if any(cow):
            self.rewritten.add(req.request_id)
        if cache_blocks:
            self._cache_full_blocks(req, min(total, req.num_tokens))
        return out

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Register the request's full blocks among its first num_tokens tokens (their K/V are in place now)."""
        self._cache_full_blocks(req, num_tokens)

    def hold(self, req: Request, transfer_id: str) -> list[int]:
        """A finished request's blocks stay allocated under `transfer_id` (for a decode worker to pull) instead
        of going back to the pool; returns their ids in table order. One-group models only (KV transfer
        moves one table)."""
        assert transfer_id not in self.held, f"transfer {transfer_id} already held"
        if len(self.groups) > 1:
            raise NotImplementedError("KV transfer of models with several KV-cache groups (sliding windows)")
        tables = self.tables.pop(req.request_id, [[]])
        self.num_cached.pop(req.request_id, None)
        self.req_hashes.pop(req.request_id, None)
        self.held[transfer_id] = tables[0]
        return [b.block_id for b in tables[0]]

    def release_held(self, transfer_id: str) -> None:
        """Held blocks back to the pool (they stay in the prefix cache until evicted)."""
        self.pool.free_blocks(list(reversed(self.held.pop(transfer_id, []))))

    def fork(self, parent: Request, child: Request, num_shared_tokens: int) -> None:
        """Give `child` the parent's block tables by reference (every block's ref_cnt + 1). Its
        first num_shared_tokens tokens must equal the parent's; writes past them copy on write."""
        assert child.request_id not in self.tables, f"{child.request_id} already holds blocks"
        tables = self.tables.get(parent.request_id, [[] for _ in self.groups])
        for t in tables:
            self.pool.touch([b for b in t if b is not NULL_BLOCK])
        self.tables[child.request_id] = [list(t) for t in tables]
        num_full = num_shared_tokens // self.block_size
        self.num_cached[child.request_id] = min(self.num_cached.get(parent.request_id, 0), num_full)
        self.req_hashes[child.request_id] = list(self.req_hashes.get(parent.request_id, [])[:num_full])

    def take_rewritten(self) -> set[str]:
        out, self.rewritten = self.rewritten, set()
        return out

    def take_block_copies(self) -> list[BlockCopy]:
        out, self.pending_copies = self.pending_copies, []
        return out

    def _cache_full_blocks(self, req: Request, num_real_tokens: int) -> None:
        """Register blocks fully covered by real (non-draft) tokens."""
        if not self.enable_caching:
            return
        num_full = num_real_tokens // self.block_size
        done = self.num_cached.get(req.request_id, 0)
        if num_full <= done:
            return
        hashes = self.block_hashes(req)
        for g, t in enumerate(self.tables[req.request_id]):
            for i in range(done, num_full):
                if t[i] is not NULL_BLOCK:
                    self.pool.cache_block(t[i], self._key(g, hashes[i]))
        self.num_cached[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first so its last blocks are evicted first. A partly filled last
        block whose last holder this was stays cached as a tail (one-group models)."""
        tables = self.tables.pop(req.request_id, [])
        for t in tables:
            self.pool.free_blocks([b for b in reversed(t) if b is not NULL_BLOCK])
        if self.enable_caching and len(tables) == 1:
            self._cache_tail(req, tables[0])
        self.num_cached.pop(req.request_id, None)
        if req.is_finished:
            self.req_hashes.pop(req.request_id, None)

    def _cache_tail(self, req: Request, table: list[KVCacheBlock]) -> None:
        num_real = min(req.num_computed_tokens, req.num_tokens)  # K/V of real tokens (not drafts) in place
        j, r = divmod(num_real, self.block_size)
        if r == 0 or j >= len(table) or table[j].ref_cnt > 0 or table[j].block_hash is not None:
            return  # no partly filled block, or others still hold (and may write) it
        hashes = self.block_hashes(req)
        start = j * self.block_size
        key = TailKey(hashes[j - 1] if j else None, req.cache_salt, tuple(req.all_token_ids[start : start + r]))
        self.pool.cache_tail(table[j], key)

    def forget(self, request_id: str) -> None:
        self.req_hashes.pop(request_id, None)

    # ------------------------------------------------------------- accounting
    def _held_blocks(self):
        """(request id, group, position in the table, block) of every non-null block a request holds."""
        for rid, tables in self.tables.items():
            for g, t in enumerate(tables):
                for j, b in enumerate(t):
                    if b is not NULL_BLOCK:
                        yield rid, g, j, b

    def min_blocks_for(self, num_tokens: int) -> int:
        """Blocks a request of num_tokens tokens holds at least at its end, summed over groups (a window holds
        the blocks its last query sees): more than the pool means it can never run."""
        full = -(-num_tokens // self.block_size)
        return sum(
            full if g.sliding_window is None else min(full, -(-g.sliding_window // self.block_size) + 1)
            for g in self.groups
        )

    def group_kind(self, g: int) -> str:
        w = self.groups[g].sliding_window
        return "global" if w is None else f"window {w}"

    def num_allocated_slots(self) -> int:
        """Physical slots in blocks held by requests (a shared block counts once)."""
        return len({b.block_id for _, _, _, b in self._held_blocks()}) * self.block_size

    def memory_usage(self, num_filled_tokens: dict[str, int]) -> KVMemoryUsage:
        """num_filled_tokens: request id -> tokens whose K/V are in its blocks."""
        bs = self.block_size
        fill: dict[int, int] = {}  # block id -> filled slots (max over holders)
        num_shared = 0
        by_kind: dict[str, int] = {}
        for rid, g, j, b in self._held_blocks():
            f = min(max(num_filled_tokens.get(rid, 0) - j * bs, 0), bs)
            old = fill.get(b.block_id)
            if old is None:
                num_shared += b.ref_cnt > 1
                fill[b.block_id] = f
                kind = self.group_kind(g)
                by_kind[kind] = by_kind.get(kind, 0) + 1
            elif f > old:
                fill[b.block_id] = f
        pool = self.pool
        return KVMemoryUsage(
            num_blocks_total=pool.num_blocks,
            num_blocks_used=pool.num_blocks - pool.num_free_blocks,
            num_blocks_free=pool.num_free_blocks,
            num_blocks_cached_free=pool.num_cached_free_blocks,
            num_blocks_shared=num_shared,
            num_allocated_slots=len(fill) * bs,
            num_filled_slots=sum(fill.values()),
            num_blocks_used_by_kind=by_kind,
        )

    def block_map(self) -> BlockMap:
        """The state of every block and who holds it: O(pool + allocated blocks), for a few looks a second."""
        states = []
        for b in self.pool.blocks:
            if b.ref_cnt == 0:
                states.append(BLOCK_FREE if b.block_hash is None else BLOCK_CACHED)
            else:
                states.append(BLOCK_USED if b.ref_cnt == 1 else BLOCK_SHARED)
        for blocks in self.held.values():
            for b in blocks:
                if b.ref_cnt == 1:
                    states[b.block_id] = BLOCK_HELD
        owners: dict[str, list[int]] = {}  # every group's blocks, group 0's first
        for rid, _, _, b in self._held_blocks():
            owners.setdefault(rid, []).append(b.block_id)
        owners.update({tid: [b.block_id for b in blocks] for tid, blocks in self.held.items()})
        return BlockMap("".join(states), owners)

    def check_integrity(self) -> None:
        refs: dict[int, int] = {}
        for b in [*(b for _, _, _, b in self._held_blocks()), *(b for bl in self.held.values() for b in bl)]:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
        self.pool.check_integrity(refs)
