"""In-flight batching (plain Python, no torch).

Every step the scheduler picks which requests advance and by how many tokens, within two limits:
`max_num_tokens` tokens per step and `max_batch_size` requests per step. Running requests go first (a
decode is one token; an unfinished prompt continues in chunks), then waiting ones in arrival order, so
new requests join the batch at the next step. Long prompts are split across steps (chunked prefill).

What fits in memory is the block manager's answer. When a running request cannot get a block, the most
recently arrived running request is preempted: its blocks are freed and it goes back to the front of the
queue, to be recomputed (its generated tokens are kept and re-fed), so no request is lost or duplicated.
Whether a waiting request may start at all is the capacity policy's answer (capacity.py): at once
(max_utilization), or once its whole length fits beside the others' (guaranteed_no_evict: never preempted).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from kiln.runtime.core.block_manager import BlockManager, CachedPrefix
from kiln.runtime.core.capacity import CapacityPolicy, MaxUtilization
from kiln.runtime.core.kv_tiers import NO_TRANSFERS, KVTransfers
from kiln.runtime.core.request import PLACEHOLDER, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_size: int
    max_num_tokens: int
    # The most distinct LoRA adapters one step may run (the worker's device slots); None: no limit.
    max_loras: int | None = None
    # A request that started at this many tokens or fewer is recomputed from scratch once it grows past it:
    # LongRoPE rotates a sequence longer than that by other factors, so keys cached before are stale
    # (transformers' Phi-3 recomputes its cache there too). None: never.
    recompute_past: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_num_tokens < 1 or (self.max_loras is not None and self.max_loras < 1):
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
    lora_int_id: int = 0  # the LoRA adapter it runs with; 0: the base model
    # Rope treats every position as in a sequence of at least this many tokens (besides num_prompt_tokens): a
    # request recomputed past LongRoPE's switch length (SchedulerLimits.recompute_past) its length then; else 0.
    rope_min_length: int = 0
    # Tree drafts (runtime/speculative/tree.py): the parent of each draft verified (-1: the last token); empty
    # for a chain. Positions and attention then follow the tree (runtime/worker/tree_rows.py).
    draft_parents: tuple[int, ...] = ()

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
    # KV blocks to copy (src, dst) before the step runs: a block beams shared, which one of them now writes
    # (copy-on-write, beam_search.py)
    block_copies: tuple[tuple[int, int], ...] = ()
    # Copies between the device pool and the host tier, made before the step's forward (kv_tiers.py)
    kv_transfers: KVTransfers = NO_TRANSFERS

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager,
                 policy: CapacityPolicy | None = None) -> None:
        self.limits = limits
        self.blocks = block_manager
        self.policy = policy if policy is not None else MaxUtilization()
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
        self._free(request)
        self.policy.ended(request)
        return request

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self, finishing: Collection[str] = ()) -> SchedulerOutput:
        """The next step. `finishing`: running requests that end when the step in flight completes (async
        scheduling knows that of a request reaching its length before its last token is read back): they
        are left out, so their tables never grow past what they may hold."""
        budget = self.limits.max_num_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        copies: list[tuple[int, int]] = []
        adapters: set[int] = set()  # the LoRA adapters this step runs (at most limits.max_loras)
        num_rows = 0  # rows of the step: a request's beams are rows of their own (max_batch_size counts rows)

        for request in list(self.running):
            if request.status != RequestStatus.RUNNING or request.request_id in finishing:
                continue  # preempted earlier in this loop, or ending
            if budget == 0 or num_rows == self.limits.max_batch_size:
                break
            rows = len(request.table_ids)
            if budget < rows or num_rows + rows > self.limits.max_batch_size:
                continue  # a request's beams run together or not at all
            if not self._adapter_fits(request, adapters):
                continue  # its adapter waits for a step with a free slot
            if self._grew_past_switch(request):  # recomputed as a preempted request is, on long factors only
                self._preempt(request)
                preempted.append(request.request_id)
                continue
            # A decoding request's drafts (speculative decoding) are computed with its last token; the budget
            # may cut them short. Beams advance in lockstep, each by num_new.
            num_new = min(request.num_tokens - request.num_computed_tokens + len(request.draft_token_ids),
                          budget // rows)
            if not self._allocate(request, request.num_computed_tokens + num_new, preempted, copies):
                continue
            scheduled.append((request, num_new))
            adapters.add(request.lora_int_id)
            budget -= num_new * rows
            num_rows += rows

        # Waiting requests start only if nobody was preempted this step (memory is known to be short).
        while self.waiting and not preempted and budget > 0 and num_rows < self.limits.max_batch_size:
            request = self._next_waiting()
            if request is None:
                break
            rows = len(request.table_ids)
            if not self.policy.admits(request) or not self._adapter_fits(request, adapters) or \
                    budget < rows or num_rows + rows > self.limits.max_batch_size:
                break  # first come, first served: nobody overtakes the head of the queue
            # A preempted request looks up its generated tokens too: its own blocks may still be cached.
            # Prompt logprobs and context logits need every prompt position computed: those requests skip the
            # cache.
            prefix = CachedPrefix()
            if not request.sampling_params.needs_prompt_positions:
                prefix = self._cached_prefix(request)
            num_new = min(request.num_tokens - prefix.num_tokens, budget // rows)
            if not self._admit(request, prefix.num_tokens + num_new, prefix):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.remove(request)  # the head, or the first that is not waiting for the disk tier
            if request.num_preemptions == 0:
                self.blocks.record_prefix_lookup(request.num_prompt_tokens, prefix.num_tokens)
                request.num_cached_prompt_tokens = prefix.num_tokens
                request.num_cached_host_tokens = prefix.num_host_tokens - prefix.num_disk_tokens
                request.num_cached_disk_tokens = prefix.num_disk_tokens
            request.num_computed_tokens = prefix.num_tokens
            request.num_tokens_at_start = request.num_tokens
            request.status = RequestStatus.RUNNING
            self.policy.started(request)
            self.running.append(request)
            scheduled.append((request, num_new))
            adapters.add(request.lora_int_id)
            budget -= num_new * rows
            num_rows += rows

        rows = tuple(row for r, n in scheduled for row in self._describe(r, n))
        # An empty step is not launched: its host-tier copies wait for the next one that is.
        return SchedulerOutput(rows, tuple(preempted), tuple(copies),
                               self.blocks.drain_transfers() if rows else NO_TRANSFERS)

    def _rope_min_length(self, request: Request) -> int:
        """A request that started past the switch length (recompute_past) is long for rope at every position."""
        limit = self.limits.recompute_past
        return request.num_tokens_at_start if limit is not None and request.num_tokens_at_start > limit else 0

    def _grew_past_switch(self, request: Request) -> bool:
        limit = self.limits.recompute_past
        return limit is not None and request.num_tokens_at_start <= limit < request.num_tokens

    def _next_waiting(self) -> Request | None:
        """The waiting request that may start next: the head of the queue, passing over requests whose prefix
        is still being read from the disk tier (`Request.kv_pending`: they would only recompute it)."""
        head = self.waiting[0]
        if not head.kv_pending:
            return head
        return next((r for r in self.waiting if not r.kv_pending), None)

    def _allocate(self, request: Request, num_tokens: int, preempted: list[str],
                  copies: list[tuple[int, int]]) -> bool:
        """Gives each of a running request's tables blocks for `num_tokens` tokens (and beams' shared blocks
        they write their own copy, added to `copies`), preempting the newest running requests while blocks are
        short; False when that preempted `request` itself."""
        mine: list[tuple[int, int]] = []
        for table_id in request.table_ids:
            while True:
                ok = self.blocks.allocate(table_id, num_tokens)
                if ok and request.beams is not None:
                    copy = self.blocks.copy_on_write(table_id, request.num_computed_tokens)
                    ok = copy is not False
                    if copy:
                        mine.append(copy)
                if ok:
                    break
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    return False
        copies.extend(mine)
        return True

    def _cached_prefix(self, request: Request) -> CachedPrefix:
        """The cached prefix a waiting request starts from. Beams start from their prompt's, which all of them
        share (they advance in lockstep); what a preempted beam generated is recomputed."""
        tokens = request.all_token_ids if request.beams is None else request.prompt_token_ids
        return self.blocks.find_cached_prefix(tokens, request.lora_int_id)

    def _admit(self, request: Request, num_tokens: int, prefix: CachedPrefix) -> bool:
        """Allocates a waiting request's tables (each starting with `prefix`), all or none."""
        tables = request.table_ids
        for k, table_id in enumerate(tables):
            if not self.blocks.allocate(table_id, num_tokens, prefix):
                for done in tables[:k]:
                    self.blocks.free(done)
                return False
        return True

    def _free(self, request: Request) -> None:
        for table_id in request.table_ids:
            self.blocks.free(table_id)

    def _adapter_fits(self, request: Request, adapters: set[int]) -> bool:
        """Whether the step can run `request` beside the adapters it already runs (the base model is free)."""
        limit = self.limits.max_loras
        return limit is None or not request.lora_int_id or request.lora_int_id in adapters or \
            len(adapters - {0}) < limit

    def _describe(self, request: Request, num_new: int) -> list[ScheduledRequest]:
        """The request's rows of the step: one, or one per beam (named by its table id)."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        known_end = min(end, request.num_tokens)
        num_sampled = end - request.num_tokens + 1 if end >= request.num_tokens else 0
        if request.beams is not None:
            return [ScheduledRequest(table_id, tuple(request.beams.token_slice(k, request.prompt_token_ids, start, end)),
                                     start, self.blocks.block_table(table_id), request.num_prompt_tokens,
                                     num_sampled, request.lora_int_id, self._rope_min_length(request))
                    for k, table_id in enumerate(request.table_ids)]
        tokens = request.token_slice(start, known_end)
        parents: tuple[int, ...] = ()
        if end > known_end:
            tokens = tokens + request.draft_token_ids[:end - known_end]
            parents = tuple(request.draft_parents[:end - known_end])  # ancestors first: a prefix is a tree
        return [ScheduledRequest(
            request_id=request.request_id,
            token_ids=tuple(tokens),
            start_position=start,
            block_ids=self.blocks.block_table(request.request_id),
            num_prompt_tokens=request.num_prompt_tokens,
            num_sampled=num_sampled,
            lora_int_id=request.lora_int_id,
            rope_min_length=self._rope_min_length(request),
            draft_parents=parents,
        )]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.draft_token_ids, request.draft_parents = [], []
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def advance_inflight(self, output: SchedulerOutput, max_seq_len: int) -> set[str]:
        """Async scheduling, before a launched step's tokens are read back: advances each of its requests past
        the tokens it computes and gives each sampled one a PLACEHOLDER output token, so the next step can be
        scheduled now (the device feeds the real token in). Returns the requests that end when the step
        completes whatever token it samples (max_tokens or max_seq_len reached): `schedule(finishing=...)`.
        Needs one sampled position per request (no drafts); `resolve_inflight` finishes the update."""
        finishing = set()
        for item in output.requests:
            request = self._requests.get(item.request_id)
            if request is None or request.status != RequestStatus.RUNNING:  # ended while the step ran
                continue
            request.num_computed_tokens += len(item.token_ids)
            if item.num_sampled:
                request.output_token_ids.append(PLACEHOLDER)
                if len(request.output_token_ids) >= request.sampling_params.max_tokens or \
                        request.num_tokens >= max_seq_len:
                    finishing.add(item.request_id)
        return finishing

    def resolve_inflight(self, output: SchedulerOutput, accepted: Mapping[str, Sequence[int]]) -> None:
        """Async scheduling, once the step `advance_inflight` advanced is read back: its sampled token replaces
        each request's PLACEHOLDER, and blocks the step filled enter the prefix cache (only now are their
        tokens known)."""
        for item in output.requests:
            request = self._requests.get(item.request_id)
            if request is None:
                continue
            if item.num_sampled:
                tokens = accepted.get(item.request_id, ())
                if len(tokens) != 1 or request.output_token_ids[-1] != PLACEHOLDER:
                    raise RuntimeError(f"request {item.request_id}: no placeholder for its token {tokens}")
                request.output_token_ids[-1] = tokens[0]
            if request.status != RequestStatus.RUNNING:  # preempted by the step scheduled since: recomputed
                continue
            # The step's tokens end at the computed count the advance left (the next step is not advanced yet).
            end = request.num_computed_tokens
            if end // self.blocks.block_size > (end - len(item.token_ids)) // self.blocks.block_size:
                self.blocks.cache_full_blocks(request.request_id, request.token_view(), end, request.lora_int_id)

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
                request.draft_token_ids, request.draft_parents = [], []
                self.blocks.trim(item.request_id, request.num_tokens)
            if request.num_computed_tokens // self.blocks.block_size > before // self.blocks.block_size:
                self.blocks.cache_full_blocks(request.request_id, request.token_view(),
                                              request.num_computed_tokens, request.lora_int_id)
