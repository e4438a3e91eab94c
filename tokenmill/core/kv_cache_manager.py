"""Per-request block tables on top of the block pool, with prefix-cache lookups.

A request's blocks cover positions [0, num_blocks * block_size). Full blocks that hold only
real tokens (never draft tokens) are hashed and registered in the prefix cache as soon as
they are allocated: within one step every layer writes all new K/V before any attention
reads, so a request scheduled in the same step may already hit them.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.block_hash import BlockHash, extend_block_hashes
from tokenmill.core.block_pool import BlockPool, KVCacheBlock
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

    # ------------------------------------------------------------------ lookups
    def block_hashes(self, req: Request) -> list[BlockHash]:
        hashes = self.req_hashes.setdefault(req.request_id, [])
        extend_block_hashes(hashes, req.all_token_ids, self.block_size, req.cache_salt)
        return hashes

    def get_computed_blocks(self, req: Request) -> ComputedBlocks:
        """Longest run of cached full blocks at the start of the request's tokens. The last
        token is never served from cache: its logits are needed."""
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
        self.stats.queries += req.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return ComputedBlocks(hits, len(hits) * self.block_size)

    # --------------------------------------------------------------- allocation
    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens after the computed ones (and after the
        cache hits in `computed`). Returns the newly allocated blocks, or None if the pool
        cannot supply them (nothing changes then)."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        hits = computed.blocks if computed else []
        num_computed = req.num_computed_tokens + (computed.num_tokens if computed else 0)
        total = num_computed + num_new_tokens
        num_required = -(-total // self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(hits))
        # Hits sitting in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_blocks[req.request_id]
            return None
        self.pool.touch(hits)
        blocks.extend(hits)
        new = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new)
        self._cache_full_blocks(req, min(total, req.num_tokens))
        return new

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
        return sum(len(b) for b in self.req_blocks.values()) * self.block_size

    def check_integrity(self) -> None:
        refs: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        self.pool.check_integrity(refs)
