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
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.block_hash import BlockHash, extend_block_hashes
from tokenmill.core.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.step_io import BlockCopy
from tokenmill.request import Request


@dataclass
class ComputedBlocks:
    blocks: list[KVCacheBlock]
    num_tokens: int


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
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached: dict[str, int] = {}
        """Blocks of each request already registered in the prefix cache."""
        self.stats = PrefixCacheStats()
        self.pending_copies: list[BlockCopy] = []
        self.held: dict[str, list[KVCacheBlock]] = {}
        """Blocks of finished requests kept for a decode worker to pull (disaggregation), by transfer id."""
        self.rewritten: set[str] = set()
        """Requests whose block table changed other than by appending (copy on write) since
        take_rewritten(); every other table only grows."""
        """Copy-on-write copies queued since the last `take_block_copies`, in order."""

    # ------------------------------------------------------------------ lookups
    def block_hashes(self, req: Request) -> list[BlockHash]:
        hashes = self.req_hashes.setdefault(req.request_id, [])
        extend_block_hashes(hashes, req.all_token_ids, self.block_size, req.cache_salt)
        return hashes

    def get_computed_blocks(self, req: Request) -> ComputedBlocks:
        """Longest run of cached full blocks at the start of the request's tokens. The last
        token is never served from cache: its logits are needed. Pure lookup: stats are counted
        by `allocate_slots` once the request is actually admitted."""
        if not self.enable_caching:
            return ComputedBlocks([], 0)
        hashes = self.block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return ComputedBlocks(hits, len(hits) * self.block_size)

    # --------------------------------------------------------------- allocation
    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: ComputedBlocks | None = None,
                       cache_blocks: bool = True) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens after the computed ones (and after the
        cache hits in `computed`). Returns the newly allocated blocks, or None if the pool
        cannot supply them (nothing changes then). cache_blocks=False: do not register the new
        full blocks in the prefix cache yet (their K/V arrive later, by a transfer: `cache_blocks`)."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        hits = computed.blocks if computed else []
        num_computed = req.num_computed_tokens + (computed.num_tokens if computed else 0)
        total = num_computed + num_new_tokens
        num_required = -(-total // self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(hits))
        # Blocks this step writes into that other requests also hold: copy on write.
        cow = [j for j in range(num_computed // self.block_size, len(blocks)) if blocks[j].ref_cnt > 1]
        # Hits sitting in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks + len(cow) > self.pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_blocks[req.request_id]
            return None
        if computed is not None:
            self.stats.queries += req.num_tokens
            self.stats.hits += computed.num_tokens
        self.pool.touch(hits)
        blocks.extend(hits)
        new = self.pool.get_new_blocks(num_new_blocks + len(cow))
        for j, dst in zip(cow, new[num_new_blocks:]):
            src = blocks[j]
            if j * self.block_size < num_computed:  # holds computed tokens: copy them
                self.pending_copies.append(BlockCopy(src.block_id, dst.block_id))
            self.pool.free_blocks([src])  # still held by the others
            blocks[j] = dst
        if cow:
            self.rewritten.add(req.request_id)
        blocks.extend(new[:num_new_blocks])
        if cache_blocks:
            self._cache_full_blocks(req, min(total, req.num_tokens))
        return new

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Register the request's full blocks among its first num_tokens tokens (their K/V are in place now)."""
        self._cache_full_blocks(req, num_tokens)

    def hold(self, req: Request, transfer_id: str) -> list[int]:
        """A finished request's blocks stay allocated under `transfer_id` (for a decode worker to pull) instead
        of going back to the pool; returns their ids in table order."""
        assert transfer_id not in self.held, f"transfer {transfer_id} already held"
        blocks = self.req_blocks.pop(req.request_id, [])
        self.num_cached.pop(req.request_id, None)
        self.req_hashes.pop(req.request_id, None)
        self.held[transfer_id] = blocks
        return [b.block_id for b in blocks]

    def release_held(self, transfer_id: str) -> None:
        """Held blocks back to the pool (they stay in the prefix cache until evicted)."""
        self.pool.free_blocks(list(reversed(self.held.pop(transfer_id, []))))

    def fork(self, parent: Request, child: Request, num_shared_tokens: int) -> None:
        """Give `child` the parent's block table by reference (every block's ref_cnt + 1). Its
        first num_shared_tokens tokens must equal the parent's; writes past them copy on write."""
        assert child.request_id not in self.req_blocks, f"{child.request_id} already holds blocks"
        blocks = self.req_blocks.get(parent.request_id, [])
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = list(blocks)
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
        blocks = self.req_blocks[req.request_id]
        for i in range(done, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first so its last blocks are evicted first."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self.pool.free_blocks(list(reversed(blocks)))
        self.num_cached.pop(req.request_id, None)
        if req.is_finished:
            self.req_hashes.pop(req.request_id, None)

    def forget(self, request_id: str) -> None:
        self.req_hashes.pop(request_id, None)

    # ------------------------------------------------------------- accounting
    def num_allocated_slots(self) -> int:
        """Physical slots in blocks held by requests (a shared block counts once)."""
        return len({b.block_id for blocks in self.req_blocks.values() for b in blocks}) * self.block_size

    def memory_usage(self, num_filled_tokens: dict[str, int]) -> KVMemoryUsage:
        """num_filled_tokens: request id -> tokens whose K/V are in its blocks."""
        bs = self.block_size
        fill: dict[int, int] = {}  # block id -> filled slots (max over holders)
        num_shared = 0
        for rid, blocks in self.req_blocks.items():
            n = num_filled_tokens.get(rid, 0)
            for j, b in enumerate(blocks):
                f = min(max(n - j * bs, 0), bs)
                old = fill.get(b.block_id)
                if old is None:
                    num_shared += b.ref_cnt > 1
                    fill[b.block_id] = f
                elif f > old:
                    fill[b.block_id] = f
        pool = self.pool
        return KVMemoryUsage(
            num_blocks_total=pool.num_blocks, num_blocks_used=pool.num_blocks - pool.num_free_blocks,
            num_blocks_free=pool.num_free_blocks, num_blocks_cached_free=pool.num_cached_free_blocks,
            num_blocks_shared=num_shared,
            num_allocated_slots=len(fill) * bs, num_filled_slots=sum(fill.values()))

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
        owners = {rid: [b.block_id for b in blocks] for rid, blocks in self.req_blocks.items()}
        owners.update({tid: [b.block_id for b in blocks] for tid, blocks in self.held.items()})
        return BlockMap("".join(states), owners)

    def check_integrity(self) -> None:
        refs: dict[int, int] = {}
        for blocks in [*self.req_blocks.values(), *self.held.values()]:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        self.pool.check_integrity(refs)
