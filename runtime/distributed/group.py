"""The process groups of one tensor-parallel engine, and the messages that cross them.

Every rank meets at a TCPStore on MASTER_ADDR:MASTER_PORT (hosted by rank 0, or by torchrun's agent). The default group runs the
network's collectives (NCCL on GPUs, gloo on CPUs); a gloo group carries rank 0's step to the others
(plain Python objects, so they build their own tensors) and the startup agreement. The store carries
what a failing rank has to say (`post_error`) and tells the ranks that rank 0 is still there.
"""

from __future__ import annotations

import datetime
import logging
import threading

import torch
import torch.distributed as dist

from .launch import RankLaunch

logger = logging.getLogger("kiln.runtime")

# Ranks wait this long for each other to start (spawning a process and importing torch takes seconds).
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)
# Workers wait for rank 0's next step for as long as the server is idle: a dead peer ends the wait at once
# (its sockets close), so this only bounds a peer that hangs.
IDLE_TIMEOUT = datetime.timedelta(days=365)
DESTROY_TIMEOUT_S = 10.0
_ERROR_KEY = "kiln/error/rank{}"
_STOPPED_KEY = "kiln/stopped/rank{}"


class RankGroups:
    """This rank's view of its engine's process groups."""

    def __init__(self, launch: RankLaunch, backend: str) -> None:
        self.launch = launch
        self.rank, self.world_size = launch.rank, launch.world_size
        self.backend = backend
        # torchrun's agent hosts the store itself (TORCHELASTIC_USE_AGENT_STORE): env:// knows how to join it.
        url = "env://" if launch.external else f"tcp://{launch.master_addr}:{launch.master_port}"
        self.store, _, _ = next(dist.rendezvous(url, rank=launch.rank, world_size=launch.world_size,
                                                timeout=RENDEZVOUS_TIMEOUT))
        dist.init_process_group(backend, store=self.store, rank=launch.rank, world_size=launch.world_size,
                                timeout=IDLE_TIMEOUT if backend == "gloo" else None)
        self.device_group = dist.group.WORLD
        self.cpu_group = (self.device_group if backend == "gloo" else
                          dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))

    def send_step(self, message: object) -> None:
        """Rank 0: the next message (a step, or None to stop) to every other rank."""
        dist.broadcast_object_list([message], src=0, group=self.cpu_group)

    def receive_step(self) -> object:
        """Ranks 1..: waits for rank 0's next message."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks each rank's memory holds)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def post_error(self, message: str) -> None:
        """Leaves this rank's last words where rank 0 reads them (best effort: the store may be gone)."""
        try:
            self.store.set(_ERROR_KEY.format(self.rank), message)
        except Exception:  # the store's host (rank 0) is gone: nobody is left to tell
            pass

    def posted_errors(self) -> dict[int, str]:
        """What ranks that failed have said, by rank."""
        out = {}
        for rank in range(self.world_size):
            key = _ERROR_KEY.format(rank)
            try:
                if self.store.check([key]):
                    out[rank] = self.store.get(key).decode(errors="replace")
            except Exception:  # the store is unreachable: report what was read
                break
        return out

    def say_stopped(self) -> None:
        """Ranks 1..: this rank has left its groups (rank 0 waits for that before leaving its own)."""
        self.store.set(_STOPPED_KEY.format(self.rank), "1")

    def wait_stopped(self, timeout: float) -> None:
        """Rank 0: waits until every other rank has said it stopped, or `timeout` seconds."""
        keys = [_STOPPED_KEY.format(rank) for rank in range(1, self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout))
        except Exception as e:  # a rank that died cannot say it; leaving anyway is all there is to do
            logger.debug("waiting for the ranks to stop: %s", e)

    def rank0_alive(self) -> bool:
        """Whether rank 0, which hosts the store, still answers."""
        try:
            self.store.check([_ERROR_KEY.format(0)])
            return True
        except Exception:  # connection refused or reset: the host is gone
            return False

    def abort(self) -> None:
        """Makes collectives blocked on a dead peer return with an error (NCCL would wait for it forever)."""
        try:
            dist.distributed_c10d._abort_process_group(self.device_group)
        except Exception as e:  # an abort that fails leaves the caller's last resort: exiting
            logger.warning("could not abort the process group: %s", e)

    def destroy(self, timeout: float = DESTROY_TIMEOUT_S) -> None:
        """Leaves the groups; gives up after `timeout` seconds (a teardown that waits on a peer that is gone,
        or on a CUDA graph that captured a collective and is still alive, must not hang the caller's exit)."""
        def leave() -> None:
            try:
                dist.destroy_process_group()
            except Exception as e:  # nothing to do about a group that cannot be torn down on the way out
                logger.debug("leaving the process groups: %s", e)

        thread = threading.Thread(target=leave, name="kiln-leave-groups", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("rank %d: leaving the process groups did not finish in %.0fs; going on", self.rank, timeout)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
