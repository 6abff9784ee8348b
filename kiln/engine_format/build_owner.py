"""Which build owns a staging directory, and removing the ones whose build is gone.

A build writes into `.NAME.XXXXXXXX.partial` beside its output (staging.py) and removes it when it fails,
but a killed build (SIGKILL, a crash, a power cut) cannot: its directory stays, as large as the weights it
had written. Each staging directory therefore holds an owner file, locked (flock) by the build for as long
as it runs and naming its host and pid. A later build of the same output removes a staging directory only
when both say its build is gone: the lock can be taken (the kernel drops a dead process's locks) and, on
this host, no process has that pid. A directory on another host's build, or one without an owner file (kiln
before this file, or a build in the instant between making its directory and locking it), is left alone.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import IO

logger = logging.getLogger("kiln.builder")

OWNER_FILE = ".kiln-build-owner"


def staging_pattern(target: Path) -> re.Pattern[str]:
    """The names tempfile.mkdtemp gives `target`'s staging directories (8 random characters), and no other
    output's: `.engine.v2.XXXXXXXX.partial` is engine.v2's, not engine's."""
    return re.compile(re.escape(f".{target.name}.") + r"[a-z0-9_]{8}\.partial")


def claim(staging: Path) -> IO[str]:
    """Marks `staging` as this process's: its owner file, locked until `release`."""
    handle = open(staging / OWNER_FILE, "w", encoding="utf-8")  # noqa: SIM115 (held open: the lock lives with it)
    fcntl.flock(handle, fcntl.LOCK_EX)  # waits only while another build's cleanup looks at it (an instant)
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    handle.flush()
    return handle


def release(staging: Path, handle: IO[str]) -> None:
    """Removes the owner file (it must not move into the engine) and drops the lock."""
    try:
        (staging / OWNER_FILE).unlink(missing_ok=True)
    finally:
        handle.close()


def remove_stale_stagings(target: Path) -> list[Path]:
    """Removes `target`'s staging directories whose build is gone (see the module docstring); returns them."""
    pattern = staging_pattern(target)
    try:
        candidates = sorted(p for p in target.parent.iterdir() if pattern.fullmatch(p.name))
    except OSError:
        return []
    removed, unowned = [], []
    for staging in candidates:
        verdict = _owner_gone(staging)
        if verdict is None:
            unowned.append(staging)
        elif verdict:
            removed.append(staging)
    for staging in removed:
        logger.warning("removed %s, left by a build of %s that did not finish", staging, target)
    if unowned:
        logger.warning("%s: %s may be left by an unfinished build of %s; kiln cannot tell whether one still "
                       "writes there, so remove it yourself once no build is running", target.parent,
                       ", ".join(p.name for p in unowned), target.name)
    return removed


def _owner_gone(staging: Path) -> bool | None:
    """True after removing `staging` because its build is gone, False while it runs (or runs elsewhere),
    None when it has no owner file to tell."""
    try:
        handle = open(staging / OWNER_FILE, "r+", encoding="utf-8")  # noqa: SIM115 (closed in finally)
    except FileNotFoundError:
        return None if staging.is_dir() else False  # gone meanwhile: finished or removed by another build
    except OSError:
        return False
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its build holds the lock: still running
        try:
            owner = json.loads(handle.read() or "{}")
        except ValueError:
            owner = {}
        if owner.get("host") != socket.gethostname() or _pid_alive(owner.get("pid")):
            return False  # another host's build, or a live pid (perhaps reused: then it is left, never lost)
        shutil.rmtree(staging, ignore_errors=True)  # still holding the lock: no other build removes it too
        return True
    finally:
        handle.close()


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return True  # an owner file that names no pid proves nothing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True
