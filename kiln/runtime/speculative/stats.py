"""Acceptance counters of speculative decoding (plain Python), in vLLM's definitions."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculationStats:
    """Counts over every verify step of a request that had drafts.

    acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts (tokens a verify
    step yields per request, the target's own token included); acceptance at position i = steps whose
    draft i was accepted / steps (a draft is accepted only when all before it were)."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verify steps with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verify step: `num_draft_tokens` drafts, the first `num_accepted` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict:
        """The counters and the rates derived from them (rates are 0.0 before the first draft)."""
        drafts = self.num_drafts
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_drafts": drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "mean_accepted_length": 1 + self.num_accepted_tokens / drafts if drafts else 0.0,
            "acceptance_per_position": [a / drafts if drafts else 0.0 for a in self.accepted_per_position],
        }
