"""The store every rank of a tensor-parallel engine meets at, and which clients of it are ranks.

A `TCPStore` serves any key to anyone who connects, and torch's listens on every interface whatever host name
it is given. So:
- Rank 0 of an engine that starts its own ranks hosts the store on a socket it bound to MASTER_ADDR (127.0.0.1)
  itself (`master_listen_fd`); nothing off this machine can connect. A launcher's store (torchrun's agent) is
  the launcher's: there the secret below is what guards the engine's keys.
- Every rank proves that it knows the launch's shared secret, `KILN_TP_SECRET`, before any other rank trusts
  it: rank 0 posts a fresh nonce, each rank posts HMAC(secret, nonce, its rank), rank 0 checks every proof and
  posts its own. The engine's keys (the process groups' addresses, the ranks' last words) then live under a
  prefix derived from the secret and the nonce, which a client without the secret cannot name, and steps that
  cross the network carry a MAC under a key derived the same way (`group.RankGroups.send_step`). Rank 0
  makes a random secret for the ranks it starts (their environment carries it); a multi-host launch must set
  one, and is refused without.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import itertools
import logging
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.distributed as dist

from kiln.engine_format import EngineError
from kiln.runtime.distributed.launch import RankLaunch

logger = logging.getLogger("kiln.runtime")

SECRET_VARIABLE = "KILN_TP_SECRET"
# Keys outside the secret's prefix: only the nonce and the proofs, which are of no use without the secret.
_HELLO = "kiln-tp/{attempt}.{engine}/hello/"
# Engines this process has joined under a launcher: every rank of an SPMD program (torchrun) makes the same
# engines in the same order, so the count tells one engine's handshake from an earlier one's on the launcher's
# long-lived store.
_engines = itertools.count()


@dataclass(frozen=True)
class Admission:
    """A rank's way into its engine once every rank proved the secret: the store under the engine's prefix,
    and the key that authenticates steps sent over the network."""

    store: dist.Store
    step_key: bytes = field(repr=False)


def new_secret() -> str:
    """A fresh secret for ranks that rank 0 starts itself (256 random bits, hex)."""
    return secrets.token_hex(32)


def launch_secret(launch: RankLaunch, env: Mapping[str, str] = os.environ) -> str:
    """This rank's copy of the launch's secret. A launch across machines without KILN_TP_SECRET is an
    EngineError naming the variable; a launcher's ranks all on this machine (MASTER_ADDR loopback) may go
    without (their keys are then only as private as the launcher's store)."""
    secret = env.get(SECRET_VARIABLE, "")
    if secret:
        return secret
    if not launch.external:
        raise EngineError(f"{SECRET_VARIABLE} is not set: rank 0 sets it for the ranks it starts, so this rank "
                          f"was not started by a kiln engine's rank 0")
    if launch.single_host:
        if launch.rank == 0:
            logger.warning("tensor-parallel launch without %s: the launcher's store (torchrun's listens on every "
                           "interface) guards nothing; set %s to the same random string on every rank",
                           SECRET_VARIABLE, SECRET_VARIABLE)
        return ""
    raise EngineError(
        f"this is rank {launch.rank} of a tensor-parallel launch across machines (WORLD_SIZE={launch.world_size}, "
        f"{launch.local_world_size} on this one, MASTER_ADDR={launch.master_addr}), whose store and step channel "
        f"anyone on the network could reach: set {SECRET_VARIABLE} to the same random string on every rank, e.g. "
        f"export {SECRET_VARIABLE}=$(python -c 'import secrets; print(secrets.token_hex(32))')")


def open_store(launch: RankLaunch, secret: str, timeout: datetime.timedelta,
               env: Mapping[str, str] = os.environ) -> Admission:
    """Meets the other ranks at the launch's store and admits them (see the module docstring). An EngineError
    names a rank whose secret differs from rank 0's."""
    return _admit(_connect(launch, timeout, env), launch, secret, timeout, env)


def host_store(address: str, port: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore that listens on `address` only (torch's own binds every interface, whatever host name it is
    given): the listening socket is made here and handed over."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(512)
        fd = listener.detach()  # the store owns the descriptor from here on
    except BaseException:
        listener.close()
        raise
    return dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=fd)


def _connect(launch: RankLaunch, timeout: datetime.timedelta, env: Mapping[str, str]) -> dist.Store:
    # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE): every rank is a client of it.
    agent = launch.external and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if launch.rank == 0 and not agent:
        if launch.single_host:
            return host_store(launch.master_addr, launch.master_port, launch.world_size, timeout)
        # Ranks on other machines must reach it: every interface, the secret guarding the keys.
        return dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=True,
                             timeout=timeout, wait_for_workers=False)
    return dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=False,
                         timeout=timeout)


def _admit(store: dist.Store, launch: RankLaunch, secret: str, timeout: datetime.timedelta,
           env: Mapping[str, str]) -> Admission:
    # A store of our own is this engine's alone; a launcher's outlives engines (and restarts of its ranks).
    engine = next(_engines) if launch.external else "local"
    hello = _HELLO.format(attempt=env.get("TORCHELASTIC_RESTART_COUNT", "0"), engine=engine)
    if launch.rank == 0:
        nonce = secrets.token_hex(16)
        store.set(hello + "nonce", nonce)
        ranks = range(1, launch.world_size)
        store.wait([f"{hello}rank{r}" for r in ranks], timeout)
        for r in ranks:
            if not hmac.compare_digest(store.get(f"{hello}rank{r}"), _proof(secret, nonce, "rank", r)):
                raise EngineError(f"rank {r} did not prove that it knows this launch's {SECRET_VARIABLE}: set the "
                                  f"same {SECRET_VARIABLE} on every rank (or another program is using "
                                  f"{launch.master_addr}:{launch.master_port})")
        store.set(hello + "rank0", _proof(secret, nonce, "rank0-admits", 0))
    else:
        store.wait([hello + "nonce"], timeout)
        nonce = store.get(hello + "nonce").decode(errors="replace")
        store.set(f"{hello}rank{launch.rank}", _proof(secret, nonce, "rank", launch.rank))
        store.wait([hello + "rank0"], timeout)
        if not hmac.compare_digest(store.get(hello + "rank0"), _proof(secret, nonce, "rank0-admits", 0)):
            raise EngineError(f"rank 0 at {launch.master_addr}:{launch.master_port} did not prove that it knows "
                              f"this launch's {SECRET_VARIABLE}: set the same {SECRET_VARIABLE} on every rank")
    prefix = _proof(secret, nonce, "store", 0)[:32].decode()
    return Admission(dist.PrefixStore(f"kiln-tp/{prefix}/", store), _digest(secret, nonce, "steps"))


def _digest(secret: str, nonce: str, purpose: str, rank: int = 0) -> bytes:
    return hmac.new(secret.encode(), f"kiln-tp|{purpose}|{nonce}|{rank}".encode(), hashlib.sha256).digest()


def _proof(secret: str, nonce: str, purpose: str, rank: int) -> bytes:
    return _digest(secret, nonce, purpose, rank).hex().encode()
