"""A process group that belongs to one engine, not to the process.

`torch.distributed.init_process_group` makes the process's one default group: a second tensor-parallel engine in
the same process (after the first was dropped, or beside it: a TP draft next to a TP target, an `LLM` next to
`kiln serve`) would fail with "trying to initialize the default process group twice". So each engine builds its
groups' backends (`ProcessGroupGloo`, `ProcessGroupNCCL`) directly on its own store and calls them directly:
nothing of it is registered in torch.distributed's global state, and dropping the engine releases them.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger("kiln.runtime")


class OwnGroup:
    """`backend` ("gloo" or "nccl") over `store` (a prefix of the engine's store that no other group uses),
    as rank `rank` of `world_size`. The collectives block until done, like torch.distributed's without
    `async_op` (for NCCL: the current stream waits for the collective, so CUDA graphs capture it)."""

    def __init__(self, backend: str, store: dist.Store, rank: int, world_size: int,
                 timeout: datetime.timedelta | None) -> None:
        self.backend = backend
        self.rank, self.world_size = rank, world_size
        timeout = timeout or datetime.timedelta(minutes=10)  # torch's default for NCCL
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            raise ValueError(f"process group backend {backend!r}: kiln uses 'gloo' (CPU) or 'nccl' (CUDA)")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        self._pg.broadcast([tensor], options).wait()

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """In place."""
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._pg.allreduce([tensor], options).wait()

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """output: [world_size * N, ...] <- every rank's tensor [N, ...], in rank order."""
        self._pg._allgather_base(output, tensor).wait()

    def abort(self) -> None:
        """Makes collectives blocked on a dead peer return with an error (NCCL would wait forever)."""
        self._pg.abort()

    def shutdown(self) -> None:
        """Releases the communicator (NCCL's, now; gloo's sockets close when the object goes)."""
        try:
            self._pg.shutdown()
        except Exception as e:  # a backend without shutdown, or one whose peer is gone: nothing more to do
            logger.debug("shutting down a %s group: %s", self.backend, e)
