"""Runner-side operations on shared KV blocks: copy-on-write copies and sampling the forked
samples of a prompt from their leader's logits row."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.core.step_io import BlockCopy, StepTokens


def copy_blocks(kv_caches: list[torch.Tensor], copies: Sequence[BlockCopy]) -> None:
    """kv_caches: per layer [2, num_blocks, block_size, Hkv, D]. Copies every pair's K and V (and,
    for an int8 cache, the packed scales) in all layers. Destinations are fresh blocks, never a
    source in the same list, so one gather + scatter per layer is exact."""
    dev = kv_caches[0].device
    src = torch.tensor([c.src for c in copies], dtype=torch.long, device=dev)  # [num_copies]
    dst = torch.tensor([c.dst for c in copies], dtype=torch.long, device=dev)
    for cache in kv_caches:
        cache[:, dst] = cache[:, src]


def add_forked_samples(
    forked: list[StepTokens], logits_indices: torch.Tensor, sampling: list[StepTokens]
) -> tuple[torch.Tensor, list[StepTokens]]:
    """Append one logits row per forked sample: its leader's row (the hidden state of the prompt's
    last token), so the sampler draws the fork's first token with the fork's own parameters.

    A sampling request with k drafts owns 1 + k consecutive rows; a leader has no drafts (it is
    about to sample its first token), so its row is the last of its run:

    e.g. sampling [A (2 drafts), L], logits_indices [0, 1, 2, 9], forked [L#1, L#2] of L
         -> sampling [A, L, L#1, L#2], logits_indices [0, 1, 2, 9, 9, 9]
    """
    row: dict[str, int] = {}
    end = 0
    for s in sampling:
        end += 1 + s.num_spec_tokens
        row[s.request_id] = end - 1
    extra: list[int] = []
    for f in forked:
        assert f.fork_of is not None, "a forked sample names its leader"
        extra.append(int(logits_indices[row[f.fork_of]]))
    idx = torch.cat([logits_indices, torch.tensor(extra, dtype=logits_indices.dtype, device=logits_indices.device)])
    return idx, sampling + list(forked)


def compact_accepted_path(kv_caches: list[torch.Tensor], block_ids: list[int], base: int, accepted: list[int]) -> None:
    """After a token tree was verified: move the accepted nodes' K/V (every layer) into consecutive slots.
    A tree step writes node i's K/V at the request's position base + i (listing order, spec_decode/tree.py);
    the accepted path [a_0, a_1, ...] must end at positions base, base + 1, ... . Nodes are listed parents
    first, so a_j >= j and a later source is never an earlier destination; copying in order is exact.

        base 10, accepted [0, 2, 4]:  position 10 <- 10, 11 <- 12, 12 <- 14
    """
    bs = kv_caches[0].shape[2]

    def slot(pos: int) -> int:
        return block_ids[pos // bs] * bs + pos % bs

    moves = [(slot(base + a), slot(base + j)) for j, a in enumerate(accepted) if a != j]
    for cache in kv_caches:
        flat = cache.view(2, -1, *cache.shape[3:])  # [2, num_slots, Hkv, D]
        for src, dst in moves:  # in order: a move may read an earlier one's source
            flat[:, dst] = flat[:, src]
