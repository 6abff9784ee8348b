"""Where the ranks of a tensor-parallel engine come from: started here by rank 0 (one process per rank on
this machine), or started by `torchrun` (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and LOCAL_RANK), each process running the same command."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kiln.engine_format import EngineError
from kiln.runtime.distributed.channel import PipeSender

# -P (Python 3.11+): the current directory does not go first on the worker's sys.path, so a checkout's
# top-level kiln/ folder cannot shadow the installed package.
_SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


@dataclass(frozen=True)
class RankLaunch:
    """How this process joins its engine's ranks. `external`: a launcher started every rank (rank 0 starts
    none); otherwise rank 0 starts ranks 1..world_size-1 on this machine. `local_world_size`: ranks on this
    machine (they share its CPU cores and number their GPUs by `local_rank`)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int
    local_world_size: int
    external: bool

    @property
    def single_host(self) -> bool:
        """Every rank runs on this machine and they meet on a loopback address: their sockets need not (and so
        do not) listen anywhere else."""
        return self.local_world_size == self.world_size and is_loopback(self.master_addr)

    def for_rank(self, rank: int) -> RankLaunch:
        """The launch of a rank that rank 0 starts on this machine."""
        return RankLaunch(rank, self.world_size, self.master_addr, self.master_port, rank, self.local_world_size,
                          self.external)


def launch_from_env(env: Mapping[str, str] = os.environ) -> RankLaunch | None:
    """The launcher's RANK, WORLD_SIZE, ... when a launcher started this process, else None. A ValueError
    names a variable that is missing or not a number."""
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    missing = [v for v in LAUNCH_VARIABLES if v not in env]
    if missing:
        raise ValueError(f"WORLD_SIZE and RANK are set, as by torchrun, but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not: set all of {', '.join(LAUNCH_VARIABLES)}")
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        raw = env.get(name, env["WORLD_SIZE"] if name == "LOCAL_WORLD_SIZE" else None)
        try:
            numbers[name] = int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None
    if not 0 <= numbers["RANK"] < numbers["WORLD_SIZE"]:
        raise ValueError(f"RANK={numbers['RANK']} must be in [0, WORLD_SIZE={numbers['WORLD_SIZE']})")
    return RankLaunch(numbers["RANK"], numbers["WORLD_SIZE"], env["MASTER_ADDR"], numbers["MASTER_PORT"],
                      numbers["LOCAL_RANK"], numbers["LOCAL_WORLD_SIZE"], external=True)


def is_loopback(address: str) -> bool:
    """Whether `address` is a loopback IP address or `localhost` (host names are not resolved)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def local_launch(world_size: int) -> RankLaunch:
    """Rank 0 of `world_size` ranks that it starts itself on this machine, meeting on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return RankLaunch(0, world_size, "127.0.0.1", port, 0, world_size, external=False)


def rank_device(device: torch.device, launch: RankLaunch, engine_dir: object) -> torch.device:
    """This rank's device: GPU `local_rank` on CUDA, the CPU otherwise. An EngineError says how many GPUs
    the engine needs when fewer are visible, or that a GPU index cannot be chosen for a tensor-parallel engine."""
    if device.type != "cuda":
        return device
    if device.index not in (None, 0):
        raise EngineError(f"engine {engine_dir} runs on {launch.world_size} GPUs, one per rank (cuda:0 to "
                          f"cuda:{launch.local_world_size - 1}): choose them with CUDA_VISIBLE_DEVICES instead of "
                          f"--device {device}")
    visible = torch.cuda.device_count()
    if launch.local_rank >= visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise EngineError(f"engine {engine_dir} is split over tp_size={launch.world_size} ranks, one GPU each, "
                          f"and needs {launch.local_world_size} GPUs on this machine, but {visible} "
                          f"{'is' if visible == 1 else 'are'} visible"
                          + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "")
                          + f": make {launch.local_world_size} visible, or rebuild with --tp-size {visible}")
    return torch.device("cuda", launch.local_rank)


def start_local_workers(start_message: Callable[[int], bytes], launch: RankLaunch,
                        env: Mapping[str, str]) -> list[subprocess.Popen]:
    """Starts ranks 1..world_size-1 as fresh Python processes running `kiln.runtime.distributed.worker_main`,
    whose stdin stays open as the step channel (`channel.py`); its first message is `start_message(rank)`
    (`step_codec.encode_start`). `env`: added to this process's environment for them (the launch's secret).
    Not multiprocessing: its spawn re-runs the caller's main module, which a script without an
    `if __name__ == "__main__"` guard cannot survive. A worker ends when rank 0 stops it or disappears."""
    processes = []
    for rank in range(1, launch.world_size):
        process = subprocess.Popen([sys.executable, *_SAFE_PATH, "-m", "kiln.runtime.distributed.worker_main"],
                                   stdin=subprocess.PIPE, env={**os.environ, **env})
        PipeSender([process.stdin]).send(start_message(rank))
        processes.append(process)
    return processes
