"""Per-chunk sha256 digests of a manifest file: its layout, a hasher that makes them while the file is written,
and the check of a manifest's chunk keys.

One sha256 runs on one thread (~1.4 GB/s), so a 16 GB weight file takes 11 s to hash however many cores the
machine has. A file also listed as consecutive chunks of `chunk_bytes` (the last one shorter), each with its own
sha256, is verified by hashing its chunks in parallel. The whole-file sha256 stays in the manifest for other
tools and older kilns, which ignore the chunk keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

MIB = 1 << 20
CHUNK_UNIT_BYTES = MIB  # chunk sizes are multiples of this, so chunked reads stay page- and block-aligned
MAX_CHUNK_BYTES = 1 << 32  # 4 GiB: a larger chunk would hash no faster than the whole file does
# What `kiln build` uses for weight files: 64 chunks for a 16 GB rank, ~0.2 s each on one core.
DEFAULT_CHUNK_BYTES = 256 * MIB


def chunk_count(size: int, chunk_bytes: int) -> int:
    """How many chunks of `chunk_bytes` a file of `size` bytes has (the last may be shorter; 0 for an empty file)."""
    return -(-size // chunk_bytes)


def chunk_ranges(size: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(begin, end) byte offsets of each chunk, in order."""
    for begin in range(0, size, chunk_bytes):
        yield begin, min(begin + chunk_bytes, size)


class ChunkHasher:
    """The sha256 of every consecutive `chunk_bytes` of a byte stream, fed in pieces of any size."""

    def __init__(self, chunk_bytes: int) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be positive")
        self.chunk_bytes = chunk_bytes
        self._digest = hashlib.sha256()
        self._filled = 0
        self._done: list[str] = []

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.chunk_bytes - self._filled)
            self._digest.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self._done.append(self._digest.hexdigest())
                self._digest, self._filled = hashlib.sha256(), 0

    def digests(self) -> tuple[str, ...]:
        """The digests of all chunks fed so far, the last one partial if the stream stopped inside it."""
        return tuple(self._done) + ((self._digest.hexdigest(),) if self._filled else ())


def is_sha256_hex(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def chunk_keys_problem(size: int, chunk_bytes: Any, chunk_sha256: Any) -> str | None:
    """What is wrong with a manifest entry's "chunk_bytes" / "chunk_sha256" keys (one line naming the key and
    value), or None when they are valid for a file of `size` bytes (or both absent)."""
    if chunk_bytes is None and chunk_sha256 is None:
        return None
    if chunk_bytes is None or chunk_sha256 is None:
        present, absent = ("chunk_bytes", "chunk_sha256") if chunk_sha256 is None else ("chunk_sha256", "chunk_bytes")
        return f"has {present!r} without {absent!r}: give both or neither"
    if (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < CHUNK_UNIT_BYTES
            or chunk_bytes > MAX_CHUNK_BYTES or chunk_bytes % CHUNK_UNIT_BYTES):
        return (f"'chunk_bytes'={chunk_bytes!r:.80} must be a multiple of {CHUNK_UNIT_BYTES} bytes from "
                f"{CHUNK_UNIT_BYTES} to {MAX_CHUNK_BYTES}")
    if not isinstance(chunk_sha256, list):
        return f"'chunk_sha256'={chunk_sha256!r:.80} must be an array of 64-character lowercase hex strings"
    expected = chunk_count(size, chunk_bytes)
    if len(chunk_sha256) != expected:
        return (f"'chunk_sha256' has {len(chunk_sha256)} digest(s), but size {size} in chunks of {chunk_bytes} "
                f"bytes needs {expected}")
    for i, digest in enumerate(chunk_sha256):
        if not is_sha256_hex(digest):
            return f"'chunk_sha256'[{i}]={digest!r:.80} must be a 64-character lowercase hex string"
    return None
