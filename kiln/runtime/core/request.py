"""A request's state as the scheduler and engine see it (plain Python, no torch)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kiln.runtime.core.beam_search import BeamState
from kiln.runtime.core.sampling_params import SamplingParams

# An output token sampled by a step still running (async scheduling: the next step is scheduled before the
# token is read back, and the device feeds it in). Replaced by the real token when the step completes.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Something went wrong for this request alone (runtime/core/request_failure.py); the engine went on.
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(eq=False)
class Request:
    """One generation request. `num_computed_tokens` is its only progress counter: prefill and decode are
    the same thing, computing the tokens in `all_token_ids[num_computed_tokens:]`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Tokens of the prompt found in the prefix cache when the request was first scheduled; of them, those the
    # host tier and the disk tier held (kv_tiers.py), the rest were in the device pool.
    num_cached_prompt_tokens: int = 0
    num_cached_host_tokens: int = 0
    num_cached_disk_tokens: int = 0
    # Its prefix's blocks are being read from the disk tier: the scheduler starts others before it meanwhile.
    kv_pending: bool = False
    # Its length when it was last admitted (SchedulerLimits.recompute_past compares it).
    num_tokens_at_start: int = 0
    # Tokens a proposer guessed to follow (speculative decoding): the next step computes them after the last
    # token and samples every position, and only the prefix the target agrees with is kept.
    draft_token_ids: list[int] = field(default_factory=list)
    # Tree drafts: draft i's parent (an earlier draft's index, -1 for the last token); empty for a chain.
    draft_parents: list[int] = field(default_factory=list)
    # The LoRA adapter it runs with (LoRARequest.lora_int_id); 0: the base model.
    lora_int_id: int = 0
    # Beam search: its running beams, each a block table and a row of every step (beam_search.py); None for a
    # plain request, whose one table and row go by its request id. `output_token_ids` is then the first beam's.
    beams: BeamState | None = None

    @property
    def table_ids(self) -> list[str]:
        """Its block tables in the block manager, one per row it computes each step."""
        return [self.request_id] if self.beams is None else self.beams.table_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (this runs every step)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def token_view(self) -> TokenIds:
        """all_token_ids as a view: O(1) to make, slices cost what they hold."""
        return TokenIds(self)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens it may generate: what it may ever need in the KV cache."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens


class TokenIds(Sequence[int]):
    """A request's prompt and output tokens as one sequence, without concatenating them (`all_token_ids` is a
    new list of the whole context); a slice is a list. Reads the request's current tokens."""

    __slots__ = ("_request",)

    def __init__(self, request: Request) -> None:
        self._request = request

    def __len__(self) -> int:
        return self._request.num_tokens

    def __getitem__(self, index):
        n = self._request.num_tokens
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                return self._request.all_token_ids[index]
            return self._request.token_slice(start, max(start, stop))
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("token index out of range")
        return self._request.token_slice(index, index + 1)[0]
