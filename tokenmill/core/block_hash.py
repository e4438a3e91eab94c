"""Chained block hashes for automatic prefix caching.

    hash(block i) = sha256(hash(block i-1) || token ids of block i || extra keys)

Only full blocks are hashed. The chain makes a block's hash stand for its whole prefix, so
equal hashes mean equal prefixes; sha256 makes an accidental collision (which would serve
wrong keys and values) practically impossible. Extra keys carry `cache_salt` so tenants can
be isolated.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple, NewType, TypeAlias

BlockHash = NewType("BlockHash", bytes)


class TailKey(NamedTuple):
    """The prefix-cache key of a partly filled last block (one-group models): what precedes it and what it holds.
    Tails are found by their parent, then by the longest common prefix of their tokens with a request's."""

    parent: BlockHash | None
    """The hash of the full block before it (None: it is the first block)."""
    salt: str | None
    """The cache_salt of its request (the chain of a first block carries none)."""
    tokens: tuple[int, ...]
    """The tokens whose K/V it holds, 1 .. block_size - 1 of them."""


BlockKey: TypeAlias = BlockHash | tuple[int, BlockHash] | TailKey
"""A block's prefix-cache key: group 0's full blocks are keyed by their hash, group g's by (g, hash)
(the same tokens are different K/V in another KV-cache group), a tail block by its TailKey."""

_ROOT = BlockHash(b"tokenmill-root")


def hash_block(parent: BlockHash | None, token_ids: list[int] | tuple[int, ...], extra: str | None = None) -> BlockHash:
    h = hashlib.sha256()
    h.update(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra is not None:
        h.update(b"\x00salt:" + extra.encode())
    return BlockHash(h.digest())


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: list[int], block_size: int, extra: str | None = None
) -> None:
    """Append hashes for every full block of token_ids not hashed yet (in place)."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
