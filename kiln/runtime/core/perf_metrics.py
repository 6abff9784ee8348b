"""A request's performance metrics (`SamplingParams.return_perf_metrics`): when it arrived, was first scheduled,
produced its first and last token, and how much of the KV cache it reused. TensorRT-LLM's `RequestPerfMetrics`
(timing, KV-cache and speculative-decoding parts) flattened; its Triton backend's outputs take these names with
an `_ns` suffix (nanoseconds since the epoch). Plain Python, no torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# One clock for every timestamp: monotonic (so they are ordered) shifted to the epoch once (so a client can
# compare them with its own wall-clock times).
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def now_ns() -> int:
    """Nanoseconds since the epoch, on a clock that never goes back."""
    return time.monotonic_ns() + _EPOCH_OFFSET_NS


@dataclass(frozen=True)
class RequestPerfMetrics:
    """What `RequestOutput.perf_metrics` holds. Times are nanoseconds since the epoch, None until it happened.
    KV-cache blocks count the request's sequence (the first beam's with beam search): `kv_cache_reused_blocks`
    came from the prefix cache, `kv_cache_alloc_new_blocks` were filled by the request,
    `kv_cache_alloc_total_blocks` is both."""

    arrival_time_ns: int
    first_scheduled_time_ns: int | None
    first_token_time_ns: int | None
    last_token_time_ns: int | None
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    kv_cache_reused_blocks: int
    kv_cache_alloc_new_blocks: int
    kv_cache_alloc_total_blocks: int
    total_draft_tokens: int = 0  # speculative decoding: drafts proposed for the request
    total_accepted_draft_tokens: int = 0  # ... and kept

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (0 without any)."""
        return self.total_accepted_draft_tokens / self.total_draft_tokens if self.total_draft_tokens else 0.0


@dataclass
class PerfRecorder:
    """The engine's running record of one request's metrics (only for requests that asked)."""

    arrival_time_ns: int
    first_scheduled_time_ns: int | None = None
    first_token_time_ns: int | None = None
    last_token_time_ns: int | None = None
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0

    @classmethod
    def start(cls) -> PerfRecorder:
        return cls(now_ns())

    def scheduled(self) -> None:
        if self.first_scheduled_time_ns is None:
            self.first_scheduled_time_ns = now_ns()

    def tokens(self, num_drafts: int = 0, num_accepted: int = 0) -> None:
        """A step gave the request tokens (`num_drafts` drafts verified, `num_accepted` of them kept)."""
        self.last_token_time_ns = now_ns()
        if self.first_token_time_ns is None:
            self.first_token_time_ns = self.last_token_time_ns
        self.total_draft_tokens += num_drafts
        self.total_accepted_draft_tokens += num_accepted

    def snapshot(self, num_cached_tokens: int, num_kv_tokens: int, block_size: int) -> RequestPerfMetrics:
        """The metrics so far; `num_kv_tokens`: the tokens its KV cache holds (prompt and output)."""
        reused = num_cached_tokens // block_size
        total = max(reused, -(-num_kv_tokens // block_size))
        return RequestPerfMetrics(self.arrival_time_ns, self.first_scheduled_time_ns, self.first_token_time_ns,
                                  self.last_token_time_ns, num_cached_tokens, reused, total - reused, total,
                                  self.total_draft_tokens, self.total_accepted_draft_tokens)
