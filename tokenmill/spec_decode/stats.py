"""Cumulative speculative-decoding counters, named as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    """Verified drafts (one per request per step that carried at least one draft token)."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    """[i] = drafts whose token at position i was accepted."""
    num_evaluated_tokens: int = 0
    """Draft depths the target actually judged (all up to and including the first rejection; a tree's
    depths, not its nodes)."""
    acceptance_length_counts: list[int] = field(default_factory=list)
    """[L] = verified drafts that emitted L tokens (1 + accepted): the acceptance length distribution."""

    def observe(self, num_draft_tokens: int, num_accepted: int, max_depth: int | None = None) -> None:
        """One verified draft: a chain of num_draft_tokens, or a tree of that many nodes and max_depth."""
        depth = num_draft_tokens if max_depth is None else max_depth
        assert 0 <= num_accepted <= depth <= num_draft_tokens
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_evaluated_tokens += min(num_accepted + 1, depth)
        if len(self.acceptance_length_counts) < num_accepted + 2:
            self.acceptance_length_counts.extend([0] * (num_accepted + 2 - len(self.acceptance_length_counts)))
        self.acceptance_length_counts[num_accepted + 1] += 1
        if len(self.num_accepted_tokens_per_pos) < num_accepted:
            self.num_accepted_tokens_per_pos.extend([0] * (num_accepted - len(self.num_accepted_tokens_per_pos)))
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft: 1 + accepted / drafts (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def mean_draft_size(self) -> float:
        """Draft tokens (tree nodes) per verified draft."""
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability under the i.i.d. model (maximum-likelihood estimate):
        accepted / judged, where judged counts tokens up to and including the first rejection."""
        return self.num_accepted_tokens / self.num_evaluated_tokens if self.num_evaluated_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "alpha": self.alpha,
        }
        d["mean_draft_size"] = self.mean_draft_size
        for i, n in enumerate(self.num_accepted_tokens_per_pos):
            d[f"num_accepted_tokens_per_pos_{i}"] = n
        for n, c in enumerate(self.acceptance_length_counts):
            if n:
                d[f"acceptance_length_{n}"] = c
        return d
