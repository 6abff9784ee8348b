"""The process groups of one tensor-parallel engine, and the messages that cross them.

Every rank meets at the launch's store (`store.py`: on MASTER_ADDR:MASTER_PORT, hosted by rank 0 or by
torchrun's agent, entered by proving the launch's secret). The device group runs the network's collectives
(NCCL on GPUs, gloo on CPUs); a gloo group carries rank 0's step to a launcher's ranks (the bytes of
`step_codec`, with a MAC) and the startup agreement. The store carries what a failing rank has to say
(`post_error`) and tells the ranks that rank 0 is still there. When every rank is on this machine
(`RankLaunch.single_host`), the groups' own sockets listen on the loopback interface only.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import logging
import os
import socket
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist

from kiln.runtime.distributed.launch import RankLaunch
from kiln.runtime.distributed.own_group import OwnGroup
from kiln.runtime.distributed.store import launch_secret, open_store

logger = logging.getLogger("kiln.runtime")

# Ranks wait this long for each other to start (spawning a process and importing torch takes seconds).
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)
# Workers wait for rank 0's next step for as long as the server is idle: a dead peer ends the wait at once
# (its sockets close), so this only bounds a peer that hangs.
IDLE_TIMEOUT = datetime.timedelta(days=365)
DESTROY_TIMEOUT_S = 10.0
# A step frame over gloo longer than this is not rank 0's (see channel.MAX_FRAME_BYTES).
MAX_STEP_BYTES = 1 << 30
# A rank's reply (gather_texts: an error message) is cut to this many bytes.
MAX_REPLY_BYTES = 4096
_MAC_BYTES = hashlib.sha256().digest_size
_ERROR_KEY = "kiln/error/rank{}"
_STOPPED_KEY = "kiln/stopped/rank{}"
# Where gloo and NCCL read the network interface their sockets listen on.
_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class RankGroups:
    """This rank's view of its engine's process groups. `secret`: the launch's (`store.launch_secret`; read
    from KILN_TP_SECRET when None)."""

    def __init__(self, launch: RankLaunch, device: torch.device, secret: str | None = None) -> None:
        self.launch = launch
        self.rank, self.world_size = launch.rank, launch.world_size
        self.backend = backend_for(device)
        admission = open_store(launch, launch_secret(launch) if secret is None else secret, RENDEZVOUS_TIMEOUT)
        self.store = admission.store
        self._step_key = admission.step_key
        self._step_count = 0  # messages sent (rank 0) or received (others): each MAC covers its number
        # The engine's own groups, not torch.distributed's default one (`own_group.py`): several engines may
        # live in one process, and a dropped one leaves nothing behind.
        with _loopback_sockets() if launch.single_host else contextlib.nullcontext():
            self.device_group = OwnGroup(self.backend, dist.PrefixStore("device/", self.store), launch.rank,
                                         launch.world_size, IDLE_TIMEOUT if self.backend == "gloo" else None)
            self.cpu_group = (self.device_group if self.backend == "gloo" else
                              OwnGroup("gloo", dist.PrefixStore("cpu/", self.store), launch.rank,
                                       launch.world_size, IDLE_TIMEOUT))
            if self.backend == "nccl":
                # NCCL makes its communicator (and its bootstrap socket) at the first collective and reads
                # NCCL_SOCKET_IFNAME once per process: make it now, while the variable says loopback.
                self.device_group.all_reduce(torch.zeros(1, device=device))

    def send_step(self, data: bytes) -> None:
        """Rank 0: the next message (`step_codec` bytes) to every other rank, with a MAC under the launch's
        step key over its number and bytes, so a rank takes only rank 0's messages, in order."""
        frame = self._mac(data) + data
        self.cpu_group.broadcast(torch.tensor([len(frame)], dtype=torch.int64))
        self.cpu_group.broadcast(torch.frombuffer(bytearray(frame), dtype=torch.uint8))

    def receive_step(self) -> bytes:
        """Ranks 1..: waits for rank 0's next message; ConnectionError for a frame whose MAC does not check."""
        size = torch.empty(1, dtype=torch.int64)
        self.cpu_group.broadcast(size)
        length = int(size.item())
        if not _MAC_BYTES <= length <= MAX_STEP_BYTES:
            raise ConnectionError(f"step channel: a frame of {length} bytes is not a message from rank 0")
        frame = torch.empty(length, dtype=torch.uint8)
        self.cpu_group.broadcast(frame)
        raw = frame.numpy().tobytes()
        mac, data = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(data)):
            raise ConnectionError("step channel: a message failed its authentication check (not rank 0's, or "
                                  "rank 0 has another KILN_TP_SECRET): refused")
        return data

    def _mac(self, data: bytes) -> bytes:
        mac = hmac.new(self._step_key, self._step_count.to_bytes(8, "little"), hashlib.sha256)
        mac.update(data)
        self._step_count += 1
        return mac.digest()

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks each rank's memory holds)."""
        t = torch.tensor([value], dtype=torch.int64)
        self.cpu_group.all_reduce(t, dist.ReduceOp.MIN)
        return int(t.item())

    def gather_texts(self, text: str) -> list[str]:
        """Every rank's `text`, in rank order, on every rank (collective over the CPU group: each rank calls
        it at the same point of rank 0's messages). What a rank says back about a message (`lora_sync.py`)."""
        data = text.encode()[:MAX_REPLY_BYTES]
        lengths = torch.empty(self.world_size, dtype=torch.int64)
        self.cpu_group.all_gather_into(lengths, torch.tensor([len(data)], dtype=torch.int64))
        width = max(1, int(lengths.max()))
        mine = torch.zeros(width, dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        texts = torch.empty(self.world_size * width, dtype=torch.uint8)
        self.cpu_group.all_gather_into(texts, mine)
        raw = texts.numpy().tobytes()
        return [raw[r * width:r * width + int(n)].decode(errors="replace") for r, n in enumerate(lengths.tolist())]

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
            self.device_group.abort()
        except Exception as e:  # an abort that fails leaves the caller's last resort: exiting
            logger.warning("could not abort the process group: %s", e)

    def destroy(self, timeout: float = DESTROY_TIMEOUT_S) -> None:
        """Leaves the groups; gives up after `timeout` seconds (a teardown that waits on a peer that is gone,
        or on a CUDA graph that captured a collective and is still alive, must not hang the caller's exit)."""
        def leave() -> None:
            try:
                for group in {id(g): g for g in (self.device_group, self.cpu_group)}.values():
                    group.shutdown()
            except Exception as e:  # nothing to do about a group that cannot be torn down on the way out
                logger.debug("leaving the process groups: %s", e)

        thread = threading.Thread(target=leave, name="kiln-leave-groups", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("rank %d: leaving the process groups did not finish in %.0fs; going on", self.rank, timeout)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def _loopback_sockets() -> Iterator[None]:
    """gloo and NCCL listen on the loopback interface while the groups are made (gloo otherwise listens on the
    address its host name resolves to, NCCL on the first non-loopback interface). The variables are put back
    afterwards: this process is also the user's."""
    interface = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if interface is None:  # no loopback interface by that name: leave the defaults (and the store is loopback)
        yield
        return
    saved = {name: os.environ.get(name) for name in _INTERFACE_VARIABLES}
    os.environ.update(dict.fromkeys(_INTERFACE_VARIABLES, interface))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
