"""The sampler's token-mask stage: which tokens each sampled row may pick (guided decoding plugs in here).

The engine asks its `TokenMasker`, when it has one, for a mask before every sampling pass; the sampler
applies it after penalties and before any choice (see `Sampler.sample`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kiln.runtime.core.request_failure import RequestFailure
from kiln.runtime.sampling.sampler import SamplingRow


class TokenMasker(Protocol):
    def token_mask(self, request_ids: Sequence[str], rows: Sequence[SamplingRow], vocab_size: int,
                   device: torch.device) -> torch.Tensor | None:
        """[len(rows), vocab_size] bool on `device`, True where row i (of request `request_ids[i]`) may pick
        the token; None when no row is constrained this step. `vocab_size` is the model's (the logits'
        width), which may exceed the tokenizer's."""
        ...

    def take_failures(self) -> dict[str, RequestFailure]:
        """Requests whose rows the last `token_mask` could not mask (their constraint allows no token, or its
        matcher failed), each with why; their rows were left unmasked and the engine ends them with
        finish_reason "error" instead of keeping the token. Cleared by the call."""
        ...

    def accept(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Advances the request's constraint past the tokens it accepted this step. True when the constraint
        has ended (guided decoding: its grammar accepted a stop token); the engine then ends the request with
        finish_reason "stop". Raises RequestFailed (runtime/core/request_failure.py) for a constraint that cannot
        go on: the engine ends that request alone."""
        ...

    def release(self, request_id: str) -> None:
        """Forgets a request that has finished or was aborted."""
        ...
