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
    """Draft tokens the target actually judged (all up to and including the first rejection)."""

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_draft_tokens
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_evaluated_tokens += min(num_accepted + 1, num_draft_tokens)
        if len(self.num_accepted_tokens_per_pos) < num_accepted:
            self.num_accepted_tokens_per_pos.extend([0] * (num_accepted - len(self.num_accepted_tokens_per_pos)))
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft: 1 + accepted / drafts (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

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
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate, "alpha": self.alpha,
        }
        for i, n in enumerate(self.num_accepted_tokens_per_pos):
            d[f"num_accepted_tokens_per_pos_{i}"] = n
        return d
