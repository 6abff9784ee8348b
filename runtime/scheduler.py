"""In-flight batching (plain Python, no torch).

Every step the scheduler picks which requests advance and by how many tokens, within two limits:
`max_num_tokens` tokens per step and `max_batch_size` requests per step. Running requests go first (a
decode is one token; an unfinished prompt continues in chunks), then waiting ones in arrival order, so
new requests join the batch at the next step. Long prompts are split across steps (chunked prefill).

What fits in memory is the block manager's answer. When a running request cannot get a block, the most
recently arrived running request is preempted: its blocks are freed and it goes back to the front of the
queue, to be recomputed (its generated tokens are kept and re-fed), so no request is lost or duplicated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .block_manager import BlockManager, CachedPrefix
from .request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_size: int
    max_num_tokens: int

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_num_tokens < 1:
            raise ValueError(f"limits must be >= 1: {self}")


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step, as plain data for the model runner."""

    request_id: str
    token_ids: tuple[int, ...]  # the tokens computed this step
    start_position: int  # position of token_ids[0] (= tokens already in the cache)
    # The request's whole block table: from the scheduler a BlockTable (block_table.py), a snapshot shared
    # with the block manager rather than copied, whose stamp lets the runner write only the blocks added since
    # it last saw the table; any other sequence of block ids works too (written whole each step).
    block_ids: Sequence[int]
    num_prompt_tokens: int
    # How many of this step's last positions are sampled: 1 when the step reaches the end of the known
    # tokens, 0 for a prefill chunk that does not. A step verifying k draft tokens samples k + 1.
    num_sampled: int

    @property
    def sample(self) -> bool:
        return self.num_sampled > 0

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        """The drafts this step verifies: the tokens after the first sampled position (sampled position j
        decides on draft j; the last one's token is the target's own)."""
        return self.token_ids[len(self.token_ids) - self.num_sampled + 1:] if self.num_sampled > 1 else ()


@dataclass(frozen=True)
class SchedulerOutput:
    requests: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager) -> None:
        self.limits = limits
        self.blocks = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in arrival order: the last one is preempted first
        self._requests: dict[str, Request] = {}

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (stop, length or abort) wherever it is, and frees its blocks."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.blocks.free(request_id)
        return request

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.limits.max_num_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []

        for request in list(self.running):
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if budget == 0 or len(scheduled) == self.limits.max_batch_size:
                break
            # A decoding request's drafts (speculative decoding) are computed with its last token; the budget
            # may cut them short.
            num_new = min(request.num_tokens - request.num_computed_tokens + len(request.draft_token_ids), budget)
            while not self.blocks.allocate(request.request_id, request.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            scheduled.append((request, num_new))
            budget -= num_new

        # Waiting requests start only if nobody was preempted this step (memory is known to be short).
        while self.waiting and not preempted and budget > 0 and len(scheduled) < self.limits.max_batch_size:
            request = self.waiting[0]
            # A preempted request looks up its generated tokens too: its own blocks may still be cached.
            # Prompt logprobs need every prompt position computed, so those requests skip the cache.
            prefix = CachedPrefix()
            if not request.sampling_params.prompt_logprobs:
                prefix = self.blocks.find_cached_prefix(request.all_token_ids)
            num_new = min(request.num_tokens - prefix.num_tokens, budget)
            if not self.blocks.allocate(request.request_id, prefix.num_tokens + num_new, prefix):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.num_preemptions == 0:
                self.blocks.record_prefix_lookup(request.num_prompt_tokens, prefix.num_tokens)
                request.num_cached_prompt_tokens = prefix.num_tokens
            request.num_computed_tokens = prefix.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new

        return SchedulerOutput(
            requests=tuple(self._describe(r, n) for r, n in scheduled),
            preempted_ids=tuple(preempted),
        )

    def _describe(self, request: Request, num_new: int) -> ScheduledRequest:
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        known_end = min(end, request.num_tokens)
        tokens = request.token_slice(start, known_end)
        if end > known_end:
            tokens = tokens + request.draft_token_ids[:end - known_end]
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tuple(tokens),
            start_position=start,
            block_ids=self.blocks.block_table(request.request_id),
            num_prompt_tokens=request.num_prompt_tokens,
            num_sampled=end - request.num_tokens + 1 if end >= request.num_tokens else 0,
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_after_step(self, output: SchedulerOutput, accepted: Mapping[str, Sequence[int]]) -> None:
        """Advances each scheduled request past the tokens it computed and appends its accepted tokens.

        `accepted` maps a request to the tokens it keeps from its sampled positions, in order (one today;
        with draft tokens, the drafts that matched and one more). Sampled positions whose tokens were
        not accepted are rolled back: their KV is recomputed later, and the prefix cache only ever hashes
        accepted tokens.
        """
        for item in output.requests:
            request = self._requests.get(item.request_id)
            if request is None:  # finished (aborted) while the step ran
                continue
            tokens = accepted.get(item.request_id, ())
            rejected = max(0, item.num_sampled - len(tokens))
            before = request.num_computed_tokens
            request.num_computed_tokens += len(item.token_ids) - rejected
            request.output_token_ids.extend(tokens)
            if item.num_sampled > 1:  # verified drafts: the rejected ones' slots go back
                request.draft_token_ids = []
                self.blocks.trim(item.request_id, request.num_tokens)
            if request.num_computed_tokens // self.blocks.block_size > before // self.blocks.block_size:
                self.blocks.cache_full_blocks(request.request_id, request.token_view(),
                                              request.num_computed_tokens)
