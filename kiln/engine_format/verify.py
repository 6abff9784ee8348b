"""Checking engine files against the manifest: sizes always, sha256 in parallel and once per file version.

Hashing a 16 GB engine takes seconds to minutes, so a file whose hash matched is stamped (see `stamps`)
and trusted on the next load while it is unchanged on disk. Files that need hashing are hashed by a
thread pool: hashlib releases the GIL while it digests large buffers, so ranks hash concurrently.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import EngineError
from .manifest import ENGINE_JSON, FileEntry, file_entry
from .stamps import FileStamp, load_stamps, save_stamps

logger = logging.getLogger("kiln.engine_format")

_MAX_HASH_THREADS = 8  # beyond this a disk, not the CPU, is the limit


@dataclass(frozen=True)
class _Hashed:
    """One file hashed: what is wrong with it, or the stamp that lets the next load trust it."""

    problem: str | None
    stamp: FileStamp | None  # None when wrong, or when the file changed while it was read


def check_files(engine_dir: Path, files: dict[str, FileEntry], verify_checksums: bool) -> None:
    """Every manifest file exists with its recorded size and, if `verify_checksums`, its sha256 (hashed once
    per file version, see `verify_sha256`). All problems are reported at once, in one line."""
    problems: list[str] = []
    present: dict[str, FileEntry] = {}
    for rel_path, entry in sorted(files.items()):
        path = engine_dir / rel_path
        if not path.is_file():
            problems.append(f"{rel_path} is listed in {ENGINE_JSON} but missing")
            continue
        size = path.stat().st_size
        if size != entry.size:
            problems.append(
                f"{rel_path} is {size} bytes, the manifest says {entry.size} bytes: truncated or modified"
            )
            continue
        present[rel_path] = entry
    if verify_checksums:
        problems += verify_sha256(engine_dir, present)
    else:
        logger.info("checked the sizes of %d engine file(s) against the manifest; sha256 not verified "
                    "(verify_checksums=False)", len(files))
    if problems:
        raise EngineError(
            f"engine directory {engine_dir} does not match its manifest: " + "; ".join(sorted(problems))
            + f". The engine files are truncated or modified: rebuild the engine "
            f"(`kiln build --checkpoint ... --output {engine_dir}`) or copy it again completely"
        )


def verify_sha256(engine_dir: Path, files: dict[str, FileEntry]) -> list[str]:
    """Problems (one line each) with files whose contents do not hash to the manifest's sha256; [] if all match.

    `files` must exist with their manifest sizes (checked before). Files with a valid stamp are not read.
    Logs, at INFO, how many files were verified, how, and how long it took.
    """
    start = time.perf_counter()
    root = engine_dir.resolve()
    known = load_stamps(engine_dir)
    stamps: dict[str, FileStamp] = {}
    to_hash: list[str] = []
    for rel_path, entry in files.items():
        stamp = known.get(rel_path)
        if stamp is not None and _still_vouches(stamp, root / rel_path, entry):
            stamps[rel_path] = stamp
        else:
            to_hash.append(rel_path)

    problems: list[str] = []
    if to_hash:
        workers = min(len(to_hash), _MAX_HASH_THREADS, os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kiln-sha256") as pool:
            hashed = list(pool.map(lambda rel: _hash(root, rel, files[rel]), to_hash))
        for rel_path, result in zip(to_hash, hashed):
            if result.problem is not None:
                problems.append(result.problem)
            elif result.stamp is not None:
                stamps[rel_path] = result.stamp
    if stamps != known:  # written only when something changed, so a warm start writes nothing
        save_stamps(engine_dir, stamps)

    total = sum(entry.size for entry in files.values())
    logger.info("verified %d engine file(s) (%s) against the manifest in %.2fs (%d hashed, %d trusted by stamp)",
                len(files), format_bytes(total), time.perf_counter() - start, len(to_hash),
                len(files) - len(to_hash))
    return problems


def _still_vouches(stamp: FileStamp, path: Path, entry: FileEntry) -> bool:
    try:
        return stamp.vouches_for(path, path.stat(), entry.sha256)
    except OSError:  # gone or unreadable since the size check: hashing it reports why
        return False


def _hash(root: Path, rel_path: str, entry: FileEntry) -> _Hashed:
    path = root / rel_path
    try:
        before = path.stat()
        sha256 = file_entry(path).sha256
        after = path.stat()
    except OSError as e:
        return _Hashed(f"{rel_path} cannot be read: {e}", None)
    if sha256 != entry.sha256:
        return _Hashed(f"{rel_path} has sha256 that differs from the manifest's {entry.sha256}: modified or corrupt",
                       None)
    # Stamped only if nothing about the file changed while it was read; a file still being written is
    # hashed again on the next load instead of trusted with a stamp from the middle of the write.
    stamp = FileStamp.of(path, before, entry.sha256)
    return _Hashed(None, stamp if stamp == FileStamp.of(path, after, entry.sha256) else None)


def format_bytes(n: int) -> str:
    """`n` bytes in the largest binary unit that keeps it >= 1 (e.g. "15.0 GiB", "512 B")."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"
