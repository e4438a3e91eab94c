"""A fixed pool of KV-cache blocks with reference counts, a free queue and a prefix cache.

Free queue (doubly linked, O(1) removal from the middle):

    front -> [evict first] ... [evict last] <- back

A block whose ref_cnt drops to 0 joins the back. A free block that still has a hash stays
findable in `cached` until it is popped for reuse (eviction = least recently freed first).
A cache hit on a free block takes it out of the queue again ("touch").

Tail blocks (a request's partly filled last block, registered when its last holder frees it) are
cached the same way under a TailKey, and also listed under their parent (`tails`), so a lookup can
find the one whose tokens share the longest prefix with a request's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tokenmill.core.block_hash import BlockHash, BlockKey, TailKey


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockKey | None = None
    prev: KVCacheBlock | None = None
    next: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}{', cached' if self.block_hash else ''})"


class TailHit(NamedTuple):
    """A cached tail block whose first num_tokens tokens continue a request's prefix hit."""

    block: KVCacheBlock
    num_tokens: int


class FreeBlockQueue:
    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free = len(blocks)
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        prev = self.head
        for b in blocks:
            prev.next, b.prev = b, prev
            prev = b
        prev.next, self.tail.prev = self.tail, prev

    def popleft(self) -> KVCacheBlock:
        b = self.head.next
        assert b is not None, "the head sentinel is always linked"
        assert b is not self.tail, "no free blocks"
        self.remove(b)
        return b

    def remove(self, b: KVCacheBlock) -> None:
        assert b.prev is not None and b.next is not None, f"{b} is not in the free queue"
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.num_free -= 1

    def append(self, b: KVCacheBlock) -> None:
        last = self.tail.prev
        assert last is not None, "the tail sentinel is always linked"
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b
        self.num_free += 1

    def __iter__(self):
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockKey, KVCacheBlock] = {}
        self.tails: dict[tuple[BlockHash | None, str | None], dict[tuple[int, ...], KVCacheBlock]] = {}
        """(parent hash, salt) -> tokens -> the cached tail block holding them (the entries of `cached` under a
        TailKey, indexed by what precedes them)."""
        self.num_evictions = 0
        self.num_cached_free_blocks = 0
        """Free blocks that still carry a hash (kept as a counter: stats run every step)."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never used, or cached but unreferenced."""
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockKey) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:  # evict from the prefix cache
                self._uncache(b)
            assert b.ref_cnt == 0
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take references on cache hits; free ones leave the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
                self.num_cached_free_blocks -= b.block_hash is not None
            b.ref_cnt += 1

    def free_blocks(self, ordered: list[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue in this order
        (first in the list = evicted first)."""
        for b in ordered:
            assert b.ref_cnt > 0, f"double free of {b}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)
                self.num_cached_free_blocks += b.block_hash is not None

    def cache_block(self, block: KVCacheBlock, block_hash: BlockKey) -> None:
        """Register a full block under its hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def cache_tail(self, block: KVCacheBlock, key: TailKey) -> None:
        """Register a free tail block (its last holder just freed it); a tail already cached with the same tokens
        stays, and this block is plain free."""
        assert block.ref_cnt == 0 and block.block_hash is None
        if not self.enable_caching or key in self.cached:
            return
        block.block_hash = key
        self.cached[key] = block
        self.tails.setdefault((key.parent, key.salt), {})[key.tokens] = block
        self.num_cached_free_blocks += 1

    def longest_tail(self, parent: BlockHash | None, salt: str | None, tokens: list[int]) -> TailHit | None:
        """The cached tail after `parent` whose tokens share the longest prefix with `tokens`, or None."""
        best: TailHit | None = None
        for held, block in self.tails.get((parent, salt), {}).items():
            n = 0
            for a, b in zip(held, tokens):
                if a != b:
                    break
                n += 1
            if n > 0 and (best is None or n > best.num_tokens):
                best = TailHit(block, n)
        return best

    def evict(self, block: KVCacheBlock) -> None:
        """Drop a free block's prefix-cache entry now (as reuse would); it stays free."""
        assert block.ref_cnt == 0, f"{block} is in use"
        if block.block_hash is not None:
            self._uncache(block)

    def _uncache(self, block: KVCacheBlock) -> None:
        """A free block's prefix-cache entry goes (it is evicted)."""
        key = block.block_hash
        assert key is not None and block.ref_cnt == 0
        if self.cached.get(key) is block:
            del self.cached[key]
            if isinstance(key, TailKey):
                siblings = self.tails[(key.parent, key.salt)]
                del siblings[key.tokens]
                if not siblings:
                    del self.tails[(key.parent, key.salt)]
        block.block_hash = None
        self.num_cached_free_blocks -= 1
        self.num_evictions += 1

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Free queue holds exactly the unreferenced blocks; cached map points at hashed blocks;
        if given, expected_refs (block id -> holders) must equal the ref counts."""
        in_queue = {b.block_id for b in self.free_queue}
        assert len(in_queue) == self.free_queue.num_free, "free queue count drift"
        assert self.num_cached_free_blocks == sum(1 for b in self.free_queue if b.block_hash is not None), (
            "cached-free count drift"
        )
        for b in self.blocks:
            assert b.ref_cnt >= 0
            assert (b.ref_cnt == 0) == (b.block_id in in_queue), f"{b}: ref_cnt and free queue disagree"
            if expected_refs is not None:
                assert b.ref_cnt == expected_refs.get(b.block_id, 0), (
                    f"{b}: expected {expected_refs.get(b.block_id, 0)} refs"
                )
        for h, b in self.cached.items():
            assert b.block_hash == h, f"{b} cached under a different hash"
            if isinstance(h, TailKey):
                assert self.tails[(h.parent, h.salt)][h.tokens] is b, f"{b}: tail not indexed"
        assert sum(map(len, self.tails.values())) == sum(isinstance(h, TailKey) for h in self.cached), "tail index"
