"""Checking engine files against the manifest: sizes always, sha256 in parallel and once per file version.

Hashing a 16 GB engine takes seconds to minutes, so a file whose hash matched is stamped (see `stamps`)
and trusted on the next load while it is unchanged on disk. Files that need hashing are hashed by a
thread pool, largest first: hashlib releases the GIL while it digests large buffers, so files hash
concurrently, and with the loading that `start_verification` lets run meanwhile (the engine factory loads
weights and captures graphs while the hashes run, and waits for them before it hands the engine out; the
weights are read from disk once, the hash reading them from the page cache behind the loader or ahead of it).
A file whose manifest entry lists chunk digests (`chunks`) is hashed chunk by chunk, its chunks spread over
the pool, so one large weight file is verified by every core instead of one; other files are hashed whole.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .errors import EngineError
from .manifest import ENGINE_JSON, FileEntry
from .stamps import FileStamp, load_stamps, save_stamps

logger = logging.getLogger("kiln.engine_format")

# One sha256 thread digests ~1.4 GB/s; 16 of them outrun any local disk and most page-cache copies.
_MAX_HASH_THREADS = 16
_READ_BYTES = 8 * 1024 * 1024  # one read (and hash update) at a time, into a buffer reused per thread
_buffers = threading.local()


@dataclass(frozen=True)
class _Hashed:
    """One file hashed: what is wrong with it, or the stamp that lets the next load trust it."""

    problem: str | None
    stamp: FileStamp | None  # None when wrong, or when the file changed while it was read
    finished: float  # time.perf_counter() when it was done


class _Piece(NamedTuple):
    """One hashing task: a whole file (`index` None, read to its end) or chunk `index` of it, [begin, end)."""

    rel_path: str
    index: int | None
    begin: int
    end: int
    expected: str  # the manifest's sha256 of the file or of the chunk

    @property
    def length(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class _PieceHashed:
    """What hashing one piece found: its digest (None when cancelled), or why it could not be read, and the
    file's stat before and after, so the file is stamped only if no piece saw it change."""

    piece: _Piece
    digest: str | None
    error: str | None
    before: os.stat_result | None
    after: os.stat_result | None
    finished: float


def check_files(engine_dir: Path, files: dict[str, FileEntry], verify_checksums: bool, *,
                sha256_by_caller: bool = False) -> None:
    """Every manifest file exists with its recorded size and, if `verify_checksums`, its sha256 (hashed once
    per file version, see `verify_sha256`). All problems are reported at once, in one line.
    `sha256_by_caller`: sizes only, the caller hashes the files itself (`start_verification`)."""
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
    if verify_checksums and not sha256_by_caller:
        problems += verify_sha256(engine_dir, present)
    elif not sha256_by_caller:
        logger.info("checked the sizes of %d engine file(s) against the manifest; sha256 not verified "
                    "(verify_checksums=False)", len(files))
    if problems:
        raise manifest_error(engine_dir, problems)


def manifest_error(engine_dir: Path, problems: list[str]) -> EngineError:
    """The one error for engine files that do not match the manifest, listing every problem."""
    return EngineError(
        f"engine directory {engine_dir} does not match its manifest: " + "; ".join(sorted(problems))
        + f". The engine files are truncated or modified: rebuild the engine "
        f"(`kiln build --checkpoint ... --output {engine_dir}`) or copy it again completely"
    )


def verify_sha256(engine_dir: Path, files: dict[str, FileEntry]) -> list[str]:
    """Problems (one line each) with files whose contents do not hash to the manifest's sha256; [] if all match.

    `files` must exist with their manifest sizes (checked before). Files with a valid stamp are not read.
    Logs, at INFO, how many files were verified, how, and how long it took.
    """
    return start_verification(engine_dir, files).wait()


def start_verification(engine_dir: Path, files: dict[str, FileEntry]) -> Verification:
    """Starts hashing, in background threads, those of `files` (checked for size before) that no stamp
    vouches for; `wait()` on the result gives the problems, as `verify_sha256` does."""
    return Verification(engine_dir, files)


class Verification:
    """The sha256 checks of an engine's files, running in a thread pool from construction on.

    `wait()` blocks until every file is hashed, records the stamps of the files that matched, logs the
    summary line and returns the problems (the same list on every call). `cancel()` stops the hashing of an
    engine that will not be used (each thread stops within one read) and records nothing.
    """

    def __init__(self, engine_dir: Path, files: dict[str, FileEntry]) -> None:
        self.engine_dir = engine_dir
        self.files = files
        self.started = time.perf_counter()
        root = self._root = engine_dir.resolve()
        self._known = load_stamps(engine_dir)
        self._stamps = {rel: stamp for rel, stamp in self._known.items()
                        if rel in files and _still_vouches(stamp, root / rel, files[rel])}
        # Largest first: the longest hash (a rank's weights) starts at once, small files fill in beside it.
        self.to_hash = sorted((rel for rel in files if rel not in self._stamps), key=lambda r: -files[r].size)
        self._stop = threading.Event()
        self._futures: dict[str, list[Future[_PieceHashed]]] = {rel: [] for rel in self.to_hash}
        self._problems: list[str] | None = None
        self.seconds = 0.0  # from construction until the last file was hashed (known after wait())
        self.waited = 0.0  # how long wait() blocked
        # Longest pieces first (the stable sort keeps a file's chunks in order), so no thread is left with a
        # long piece at the end while the others idle.
        pieces = sorted((piece for rel in self.to_hash for piece in _pieces(rel, files[rel])),
                        key=lambda piece: -piece.length)
        if pieces:
            workers = min(len(pieces), _MAX_HASH_THREADS, os.cpu_count() or 1)
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kiln-sha256")
            for piece in pieces:
                self._futures[piece.rel_path].append(pool.submit(_hash_piece, root, piece, self._stop))
            pool.shutdown(wait=False)  # the workers finish the queue and exit

    @property
    def bytes_hashed(self) -> int:
        return sum(self.files[rel].size for rel in self.to_hash)

    def wait(self) -> list[str]:
        """The problems (one line each, [] when every file matched), after every hash has finished."""
        if self._problems is not None:
            return self._problems
        begin = time.perf_counter()
        problems: list[str] = []
        finished = self.started
        for rel_path, futures in self._futures.items():
            result = _combine(self._root, rel_path, self.files[rel_path], [future.result() for future in futures])
            finished = max(finished, result.finished)
            if result.problem is not None:
                problems.append(result.problem)
            elif result.stamp is not None:
                self._stamps[rel_path] = result.stamp
        self.waited = time.perf_counter() - begin
        self.seconds = (finished if self._futures else time.perf_counter()) - self.started
        if self._stamps != self._known:  # written only when something changed, so a warm start writes nothing
            save_stamps(self.engine_dir, self._stamps)
        total = sum(entry.size for entry in self.files.values())
        logger.info("verified %d engine file(s) (%s) against the manifest in %.2fs (%d hashed, %d trusted by stamp)",
                    len(self.files), format_bytes(total), self.seconds, len(self.to_hash),
                    len(self.files) - len(self.to_hash))
        self._problems = problems
        return problems

    def cancel(self) -> None:
        """Stops hashing (the engine is not going to be used); records no stamps. No-op after `wait()`."""
        self._stop.set()
        for futures in self._futures.values():
            for future in futures:
                future.cancel()

    @property
    def done(self) -> bool:
        """Whether `wait()` has returned."""
        return self._problems is not None


def _still_vouches(stamp: FileStamp, path: Path, entry: FileEntry) -> bool:
    try:
        return stamp.vouches_for(path, path.stat(), entry.sha256)
    except OSError:  # gone or unreadable since the size check: hashing it reports why
        return False


def _pieces(rel_path: str, entry: FileEntry) -> list[_Piece]:
    """The hashing tasks of one file: one per manifest chunk, or the whole file when it lists none."""
    if chunks := entry.chunks:
        return [_Piece(rel_path, i, begin, end, digest) for i, (begin, end, digest) in enumerate(chunks)]
    return [_Piece(rel_path, None, 0, entry.size, entry.sha256)]


def _hash_piece(root: Path, piece: _Piece, stop: threading.Event) -> _PieceHashed:
    path = root / piece.rel_path
    try:
        before = path.stat()
        if piece.index is None:
            digest = file_sha256(path, stop)
        else:
            digest = range_sha256(path, piece.begin, piece.end, stop)
        after = path.stat()
    except OSError as e:
        return _PieceHashed(piece, None, str(e), None, None, time.perf_counter())
    return _PieceHashed(piece, digest, None, before, after, time.perf_counter())


def _combine(root: Path, rel_path: str, entry: FileEntry, results: list[_PieceHashed]) -> _Hashed:
    """One file's verdict from its pieces: the first read error, else a mismatch naming the chunks that differ,
    else its stamp when every piece saw the file unchanged (a file still being written is hashed again on the
    next load instead of trusted with a stamp from the middle of the write)."""
    finished = max(result.finished for result in results)
    errors = [result.error for result in results if result.error is not None]
    if errors:
        return _Hashed(f"{rel_path} cannot be read: {errors[0]}", None, finished)
    if any(result.digest is None for result in results):  # cancelled: nothing about the file is known
        return _Hashed(None, None, finished)
    stats = [st for result in results for st in (result.before, result.after) if st is not None]
    if any(st.st_size != entry.size for st in stats):  # changed since the size check (a chunk read stops at its end)
        size = next(st.st_size for st in stats if st.st_size != entry.size)
        return _Hashed(f"{rel_path} is {size} bytes, the manifest says {entry.size} bytes: truncated or modified",
                       None, finished)
    bad = [result.piece for result in results if result.digest != result.piece.expected]
    if bad:
        where = ""
        if bad[0].index is not None:
            first = bad[0]
            more = f", and {len(bad) - 1} more chunk(s)" if len(bad) > 1 else ""
            where = (f" (chunk {first.index} of {len(results)}, bytes {first.begin}..{first.end - 1}, differs"
                     f"{more})")
        return _Hashed(f"{rel_path} has sha256 that differs from the manifest's {entry.sha256}: modified or "
                       f"corrupt{where}", None, finished)
    path = root / rel_path
    stamps = {FileStamp.of(path, st, entry.sha256) for st in stats}
    return _Hashed(None, stamps.pop() if len(stamps) == 1 else None, finished)


def _buffer() -> memoryview:
    """This thread's read buffer, allocated on its first use."""
    view = getattr(_buffers, "view", None)
    if view is None:
        view = _buffers.view = memoryview(bytearray(_READ_BYTES))
    return view


def file_sha256(path: Path, stop: threading.Event | None = None) -> str | None:
    """The sha256 hex digest of the file at `path`, read in chunks into one buffer; None if `stop` was set
    before the end. hashlib releases the GIL while it digests a chunk, so threads hash files in parallel."""
    digest = hashlib.sha256()
    view = _buffer()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            if stop is not None and stop.is_set():
                return None
            digest.update(view[:n])
    return digest.hexdigest()


def range_sha256(path: Path, begin: int, end: int, stop: threading.Event | None = None) -> str | None:
    """The sha256 hex digest of bytes [begin, end) of the file at `path` (fewer if the file ends first); None
    if `stop` was set before the end. Read with pread into this thread's buffer, so threads hash the chunks of
    one file in parallel."""
    digest = hashlib.sha256()
    view = _buffer()
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = begin
        while offset < end:
            if stop is not None and stop.is_set():
                return None
            n = os.preadv(fd, [view[:min(len(view), end - offset)]], offset)
            if n == 0:
                break
            digest.update(view[:n])
            offset += n
    finally:
        os.close(fd)
    return digest.hexdigest()


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
