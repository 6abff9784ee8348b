"""When a waiting request may start: the scheduler's capacity policy (TensorRT-LLM's `CapacitySchedulerPolicy`,
the Triton backend's `batch_scheduler_policy`). Plain Python, no torch.

- `max_utilization` (the default): a request starts as soon as the blocks for its next chunk are free. When
  blocks later run short, the scheduler preempts the newest running request and recomputes it (nothing is
  lost, but work is repeated): the most requests in the batch at any time.
- `guaranteed_no_evict`: a request starts, in arrival order, only once the blocks for its whole prompt plus
  `max_tokens` fit beside those reserved by the requests already started, so no running request is ever
  preempted (speculative drafts may still ask for a block past that reservation; then the usual preemption
  applies).
"""

from __future__ import annotations

from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.request import Request

CAPACITY_POLICIES = ("max_utilization", "guaranteed_no_evict")


class MaxUtilization:
    """Admits whatever the block manager can hold now; `Scheduler` preempts when blocks run short."""

    name = "max_utilization"

    def admits(self, request: Request) -> bool:
        return True

    def started(self, request: Request) -> None:
        pass

    def ended(self, request: Request) -> None:
        pass


class GuaranteedNoEvict:
    """Reserves each started request's blocks for its whole length (prompt + max_tokens) until it ends."""

    name = "guaranteed_no_evict"

    def __init__(self, blocks: BlockManager) -> None:
        self._blocks = blocks
        self._reserved: dict[str, int] = {}  # request id -> its reservation, from start to end
        self.num_reserved = 0

    def admits(self, request: Request) -> bool:
        if request.request_id in self._reserved:  # started before (preempted by a draft's block): it keeps its place
            return True
        return self.num_reserved + self._need(request) <= self._blocks.num_blocks

    def started(self, request: Request) -> None:
        if request.request_id not in self._reserved:
            need = self._need(request)
            self._reserved[request.request_id] = need
            self.num_reserved += need

    def ended(self, request: Request) -> None:
        self.num_reserved -= self._reserved.pop(request.request_id, 0)

    def _need(self, request: Request) -> int:
        # Beams may each end up in blocks of their own: the reservation covers all of them.
        return self._blocks.blocks_needed(request.max_total_tokens) * max(1, request.sampling_params.beam_width)


CapacityPolicy = MaxUtilization | GuaranteedNoEvict


def capacity_policy(name: str, blocks: BlockManager) -> CapacityPolicy:
    """The policy called `name` (one of CAPACITY_POLICIES) over `blocks`; a ValueError names the choices."""
    if name == "max_utilization":
        return MaxUtilization()
    if name == "guaranteed_no_evict":
        return GuaranteedNoEvict(blocks)
    raise ValueError(f"capacity_scheduler_policy={name!r} is not one of {', '.join(CAPACITY_POLICIES)}")
