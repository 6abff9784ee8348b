"""The proposer seam: what the engine asks of anything that proposes draft tokens.

A proposer gets, once per step and before the schedule, the running requests that are decoding, each with
the most tokens it may propose; it returns up to that many tokens per request, and for a proposer that
samples them, the distribution each was drawn from (the rejection rule needs it). The draft model, n-gram
lookup and an EAGLE-3 head (eagle3.py) are the proposers; an MTP head would be one more file behind this protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kiln.runtime.sampling.sampler import SamplingRow


@dataclass(frozen=True)
class DraftRequest:
    """A request to propose for: all its tokens so far (prompt + accepted output; the last one is not in the
    target's cache yet) and at most `max_tokens` drafts. `row`: its sampling settings and generator. A tree
    proposer (eagle_topk > 1) drafts at most `max_nodes` nodes to a depth of at most `max_tokens`."""

    request_id: str
    token_ids: Sequence[int]
    max_tokens: int
    row: SamplingRow
    max_nodes: int = 0  # 0: a chain (max_tokens drafts)
    lora_int_id: int = 0  # the LoRA adapter the target runs it with (0: the base model)


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one request, in order. `probs`: [len(token_ids), V] float32, the distribution each
    draft was sampled from, or None when each draft is certain (q is one-hot at it: greedy drafts, lookup).
    `parents` (tree drafts): node i's parent index, -1 for the request's last token, ancestors before their
    descendants; None for a chain. A tree's nodes are chosen, not sampled: probs is None."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None


class Proposer(Protocol):
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Proposal]:
        """Drafts for some of `requests` (a request left out, or with no tokens, is not speculated)."""
        ...

    def release(self, request_id: str) -> None:
        """Forgets a request that ended (its draft KV blocks, if any, return)."""
        ...

    def shutdown(self) -> None:
        """Releases what the proposer holds (a draft model's executor)."""
        ...
