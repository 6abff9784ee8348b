"""The disk tier of the prefix cache: KV blocks as files in `kv_offloading_dir`, kept across restarts.

Plain Python, no torch: the engine hands this module a block's bytes (from a host-tier slot) and gets them
back; what they mean is the host tier's business. One file per block (`kv_block_file.py`: the name carries
the engine's KV identity and the block hash, the header a checksum), so a restarted server with the same
engine finds its blocks by listing the directory, and any other engine sharing the directory ignores them.

Writes go through one background thread: `write` copies the caller's bytes and returns at once (False when
the queue is full: the block is dropped, never waited for). The writer evicts the least recently used files
before each write so that this identity's files, the one being written included, never exceed
`limit_bytes`, and writes to a temporary name that it renames into place, so a reader never sees half a
file. Files are not fsynced: after a power loss a damaged file fails its checksum and is recomputed.

LRU order: in memory, a hit makes a block most recent and also touches its file's mtime, so the next
restart's scan (oldest mtime first) keeps the order.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict, deque
from pathlib import Path

from .kv_block_file import (
    IDENTITY_BYTES,
    CorruptBlockFile,
    ForeignBlockFile,
    block_file_name,
    check_block,
    check_block_hash,
    file_size,
    kv_identity,
    list_block_files,
    pack_header,
    parse_header,
    prepare_directory,
    temp_file_name,
    unlink_quietly,
)

__all__ = ["DiskKVTier", "kv_identity"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_WRITES = 64
# A write is skipped while the filesystem has less than this free after it: the cache never fills a disk.
DEFAULT_MIN_FREE_BYTES = 256 * 1024 * 1024
# A temporary file younger than this may be another live process's write in progress (a directory shared
# by two servers of one engine, possibly on two hosts): scan leaves it alone.
TEMP_FILE_GRACE_SECONDS = 60.0
_DIR_FLAG = "kv_offloading_dir (--kv-offloading-dir)"

_COUNTERS = ("writes", "dropped", "no_space", "write_errors", "evictions", "hits", "misses", "corrupt",
             "rejected", "read_errors", "foreign")


class DiskKVTier:
    """Blocks of `block_bytes` bytes for one KV `identity` (kv_identity) in `directory`, at most
    `limit_bytes` of files. Thread-safe: `write` from the engine's thread, `read` from a reader thread."""

    def __init__(self, directory: str | os.PathLike[str], limit_bytes: int, identity: bytes, block_bytes: int,
                 *, max_pending_writes: int = DEFAULT_MAX_PENDING_WRITES,
                 min_free_bytes: int = DEFAULT_MIN_FREE_BYTES) -> None:
        for name, value, low in (("limit_bytes", limit_bytes, 1), ("block_bytes", block_bytes, 1),
                                 ("max_pending_writes", max_pending_writes, 1),
                                 ("min_free_bytes", min_free_bytes, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"DiskKVTier {name}={value!r} must be an integer >= {low}")
        if not isinstance(identity, bytes) or len(identity) != IDENTITY_BYTES:
            raise ValueError(f"DiskKVTier identity must be {IDENTITY_BYTES} bytes (kv_identity), "
                             f"got {identity!r:.80}")
        self.directory = Path(directory)
        self.limit_bytes = limit_bytes
        self.identity = identity
        self.block_bytes = block_bytes
        self.max_pending_writes = max_pending_writes
        self.min_free_bytes = min_free_bytes
        prepare_directory(self.directory, _DIR_FLAG)

        self._cond = threading.Condition()  # guards everything below; the writer waits on it
        self._index: OrderedDict[bytes, int] = OrderedDict()  # block hash -> file bytes, oldest first
        self._used = 0  # bytes of indexed files plus the write in progress
        self._reserved = 0  # bytes of the write in progress
        self._pending: deque[tuple[bytes, bytes | memoryview]] = deque()  # (block hash, payload) for the writer
        self._queued: set[bytes] = set()  # hashes queued or being written
        self._views: set[bytes] = set()  # of those, queued by write_view (the caller's memory, not a copy)
        self._finished: list[tuple[bytes, bool]] = []  # write_view's writes that ended: (hash, file written)
        self._writing = 0  # 1 while the writer handles a block taken off `_pending`
        self._closing = False
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._read_seconds = 0.0
        self._write_seconds = 0.0
        self._warned_space = False
        self._token = uuid.uuid4().hex[:12]  # this tier's temporary file names
        self.scan()
        self._thread = threading.Thread(target=self._writer_loop, name="kiln-kv-disk-writer", daemon=True)
        self._thread.start()

    # -- the index ---------------------------------------------------------------------------------------

    def scan(self) -> None:
        """Index this identity's block files (oldest mtime first), count other `.kvb` files as foreign (never
        touched: another engine may share the directory), delete this identity's stale temporary files, and
        delete the oldest files while they exceed `limit_bytes` (the limit was lowered since they were written).
        Called by __init__; to re-read the directory later, flush() first (a write finishing during a scan
        could be counted twice)."""
        found, foreign = list_block_files(self.directory, self.identity, TEMP_FILE_GRACE_SECONDS)
        with self._cond:
            self._index.clear()
            self._used = self._reserved
            for block_hash, size in found:
                self._index[block_hash] = size
                self._used += size
            self._counts["foreign"] = foreign
            victims = self._evict_locked(0)
        self._delete(victims)
        if found or foreign:
            logger.info("KV disk tier %s: %d block file(s) of this engine (%d bytes), %d of other engines",
                        self.directory, len(self), self.bytes_used, foreign)

    def __contains__(self, block_hash: bytes) -> bool:
        with self._cond:
            return block_hash in self._index

    def __len__(self) -> int:
        with self._cond:
            return len(self._index)

    @property
    def bytes_used(self) -> int:
        """Bytes of this identity's files, the one being written included."""
        with self._cond:
            return self._used

    # -- writes ------------------------------------------------------------------------------------------

    def write(self, block_hash: bytes, payload: bytes | memoryview) -> bool:
        """Queue `payload` (exactly `block_bytes` bytes, copied here) to be written as `block_hash`'s file.
        True when queued or already on disk (made most recent); False, counted `dropped`, when the queue is
        full, the tier is closed or the payload has another length. Never waits for the disk."""
        check_block_hash(block_hash)
        view = memoryview(payload)
        with self._cond:
            if self._known_locked(block_hash):
                return True
            if not self._accepts_locked(view.nbytes):
                return False
        data = view.tobytes()  # a copy: the caller may reuse its buffer as soon as this returns
        with self._cond:
            if self._known_locked(block_hash):
                return True
            if not self._accepts_locked(len(data)):
                return False
            self._pending.append((block_hash, data))
            self._queued.add(block_hash)
            self._cond.notify_all()
            return True

    def write_view(self, block_hash: bytes, payload: memoryview) -> bool:
        """`write` without the copy: the writer reads `payload` itself, so the caller must keep that memory as
        it is until the write is reported by `take_finished`. True when this call queued it (it will be
        reported); False when the block is on disk or queued already, or the write is dropped (nothing held)."""
        check_block_hash(block_hash)
        view = memoryview(payload).cast("B")
        with self._cond:
            if self._known_locked(block_hash) or not self._accepts_locked(view.nbytes):
                return False
            self._pending.append((block_hash, view))
            self._queued.add(block_hash)
            self._views.add(block_hash)
            self._cond.notify_all()
            return True

    def take_finished(self) -> list[tuple[bytes, bool]]:
        """The `write_view` writes that ended since the last call, each (block hash, whether its file is on
        disk now); their memory is the caller's again."""
        with self._cond:
            finished, self._finished = self._finished, []
        return finished

    def _known_locked(self, block_hash: bytes) -> bool:
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return True
        return block_hash in self._queued

    def _accepts_locked(self, nbytes: int) -> bool:
        if nbytes == self.block_bytes and not self._closing and len(self._pending) < self.max_pending_writes:
            return True
        self._counts["dropped"] += 1
        return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False when `timeout` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._writing, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued writes and stop the writer thread; later writes are dropped. Idempotent."""
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def __enter__(self) -> DiskKVTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _writer_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closing)
                if not self._pending:
                    return  # closing, nothing left
                block_hash, data = self._pending.popleft()
                self._writing = 1
            try:
                self._write_one(block_hash, data)
            except Exception:  # never let the thread die: later writes must still be handled or dropped
                logger.exception("KV disk tier %s: writing a block failed", self.directory)
                with self._cond:
                    self._counts["write_errors"] += 1
            finally:
                with self._cond:
                    self._queued.discard(block_hash)
                    if block_hash in self._views:
                        self._views.discard(block_hash)
                        self._finished.append((block_hash, block_hash in self._index))
                    self._writing = 0
                    self._cond.notify_all()

    def _write_one(self, block_hash: bytes, data: bytes) -> None:
        size = file_size(block_hash, len(data))
        if size > self.limit_bytes:
            with self._cond:
                self._counts["dropped"] += 1
            return
        if not self._has_space(size):
            return
        start = time.perf_counter()
        with self._cond:
            victims = self._evict_locked(size)
            self._used += size  # reserved: counted while written, so the limit holds with the file in progress
            self._reserved = size
        self._delete(victims)  # before the new file exists: the directory never holds more than the limit
        path = self.directory / block_file_name(self.identity, block_hash)
        tmp = self.directory / temp_file_name(self.identity, block_hash, self._token)
        try:
            with open(tmp, "xb") as f:
                f.write(pack_header(self.identity, block_hash, data))
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            unlink_quietly(tmp)
            logger.warning("KV disk tier: cannot write %s: %s", path, e)
            with self._cond:
                self._used -= size
                self._reserved = 0
                self._counts["write_errors"] += 1
            return
        with self._cond:
            self._reserved = 0
            self._index[block_hash] = size
            self._counts["writes"] += 1
            self._write_seconds += time.perf_counter() - start

    def _has_space(self, size: int) -> bool:
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            free = 0
        if free >= size + self.min_free_bytes:
            return True
        with self._cond:
            self._counts["no_space"] += 1
            warn, self._warned_space = not self._warned_space, True
        if warn:
            logger.warning("KV disk tier %s: %d bytes free, below the %d-byte margin; skipping block writes "
                           "while the disk is this full", self.directory, free, self.min_free_bytes)
        return False

    def _evict_locked(self, incoming: int) -> list[bytes]:
        """Drop the least recently used blocks from the index until `incoming` more bytes fit the limit; the
        caller deletes their files (outside the lock)."""
        victims = []
        while self._index and self._used + incoming > self.limit_bytes:
            block_hash, size = self._index.popitem(last=False)
            self._used -= size
            self._counts["evictions"] += 1
            victims.append(block_hash)
        return victims

    def _delete(self, block_hashes: list[bytes]) -> None:
        for block_hash in block_hashes:
            unlink_quietly(self.directory / block_file_name(self.identity, block_hash))

    # -- reads -------------------------------------------------------------------------------------------

    def read(self, block_hash: bytes) -> bytes | None:
        """The payload written for `block_hash`, checked (magic, version, identity, hash, length, checksum);
        None when there is none or it fails a check (counted `misses`, and `corrupt`, `rejected` or
        `read_errors`; a bad file is deleted). A hit makes the block most recent."""
        start = time.perf_counter()
        try:
            return self._read(block_hash)
        finally:
            with self._cond:
                self._read_seconds += time.perf_counter() - start

    def read_into(self, block_hash: bytes, out: memoryview) -> bool:
        """`read`, into `out` (a writable buffer of `block_bytes`, e.g. a host slot) instead of new bytes: True
        when `out` now holds the checked payload; False as `read`'s None (`out` then holds anything)."""
        start = time.perf_counter()
        try:
            return self._read(block_hash, out) is not None
        finally:
            with self._cond:
                self._read_seconds += time.perf_counter() - start

    def _read(self, block_hash: bytes, out: memoryview | None = None) -> bytes | memoryview | None:
        with self._cond:
            known = block_hash in self._index
        if not known:
            self._count("misses")
            return None
        path = self.directory / block_file_name(self.identity, block_hash)
        try:
            with open(path, "rb") as f:
                actual_size = os.fstat(f.fileno()).st_size
                header = parse_header(f.read(file_size(block_hash, 0)), len(block_hash))
                if out is None:
                    payload = f.read(min(header.payload_len, actual_size))
                else:  # straight into the caller's buffer (a pinned host slot): no copy
                    out = memoryview(out).cast("B")
                    payload = out[:f.readinto(out[:min(header.payload_len, len(out))])]
            check_block(header, payload, identity=self.identity, block_hash=block_hash,
                        payload_len=self.block_bytes, actual_size=actual_size)
        except FileNotFoundError:  # evicted (or removed by hand) since the index was read
            self._forget(block_hash, None, "misses")
            return None
        except OSError as e:
            logger.warning("KV disk tier: cannot read %s: %s", path, e)
            self._forget(block_hash, path, "read_errors")
            return None
        except CorruptBlockFile as e:
            logger.warning("KV disk tier: %s is damaged (%s); deleted, the block will be recomputed", path, e)
            self._forget(block_hash, path, "corrupt")
            return None
        except ForeignBlockFile as e:
            logger.warning("KV disk tier: %s was %s; deleted", path, e)
            self._forget(block_hash, path, "rejected")
            return None
        with self._cond:
            self._counts["hits"] += 1
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        try:
            os.utime(path)  # the next restart's LRU order
        except OSError:
            pass
        return payload

    def _forget(self, block_hash: bytes, path: Path | None, counter: str) -> None:
        with self._cond:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._used -= size
            self._counts[counter] += 1
            if counter != "misses":
                self._counts["misses"] += 1
            if path is not None:
                unlink_quietly(path)

    def _count(self, counter: str) -> None:
        with self._cond:
            self._counts[counter] += 1

    # -- visibility --------------------------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        """Counters since startup: files, bytes (this identity's, the write in progress included),
        limit_bytes, pending (writes queued), writes (files written), dropped (writes refused: queue full,
        wrong length, over the limit), no_space (writes skipped: disk nearly full), write_errors, evictions,
        hits (reads that returned bytes), misses (reads that returned None; corrupt, rejected and
        read_errors are among them), corrupt (bad checksum, truncated), rejected (another identity), foreign
        (other engines' .kvb files at the last scan), read_seconds, write_seconds."""
        with self._cond:
            return {"files": len(self._index), "bytes": self._used, "limit_bytes": self.limit_bytes,
                    "pending": len(self._pending) + self._writing, **self._counts,
                    "read_seconds": self._read_seconds, "write_seconds": self._write_seconds}

