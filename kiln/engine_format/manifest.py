"""The engine's file manifest: every file with its size and sha256 (and, for large files, per-chunk sha256s, see
`chunks`), parsed and validated (`verify` checks files)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .chunks import chunk_keys_problem, chunk_ranges, is_sha256_hex
from .errors import EngineError

ENGINE_JSON = "engine.json"
_HASH_CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class FileEntry:
    """One manifest entry: the file's size in bytes and the sha256 hex digest of its contents; optionally also
    the sha256 of each consecutive `chunk_bytes` of it (the last chunk shorter), which verification hashes in
    parallel. Both chunk fields are set or neither."""

    size: int
    sha256: str
    chunk_bytes: int | None = None
    chunk_sha256: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        chunks = None if self.chunk_sha256 is None else list(self.chunk_sha256)
        if problem := chunk_keys_problem(self.size, self.chunk_bytes, chunks):
            raise ValueError(f"FileEntry of {self.size} bytes {problem}")

    @property
    def chunks(self) -> list[tuple[int, int, str]]:
        """(begin, end, sha256) of each chunk; [] when the entry has no chunk digests."""
        if self.chunk_bytes is None or self.chunk_sha256 is None:
            return []
        return [(b, e, d) for (b, e), d in zip(chunk_ranges(self.size, self.chunk_bytes), self.chunk_sha256,
                                              strict=True)]

    def to_json(self) -> dict[str, Any]:
        """The entry as engine.json's manifest writes it: chunk keys only when present."""
        entry: dict[str, Any] = {"size": self.size, "sha256": self.sha256}
        if self.chunk_sha256 is not None:
            entry["chunk_bytes"] = self.chunk_bytes
            entry["chunk_sha256"] = list(self.chunk_sha256)
        return entry


def file_entry(path: str | Path) -> FileEntry:
    """Size and sha256 of a file, read in 1 MiB chunks into one buffer so memory stays flat for any size."""
    digest = hashlib.sha256()
    size = 0
    buffer = bytearray(_HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])  # hashlib releases the GIL here, so threads hash files in parallel
            size += n
    return FileEntry(size=size, sha256=digest.hexdigest())


def parse_manifest(engine_dir: Path, raw_files: dict[str, Any], hint: str) -> dict[str, FileEntry]:
    where = f"{engine_dir / ENGINE_JSON} field 'files'"
    files: dict[str, FileEntry] = {}
    for rel_path, raw in raw_files.items():
        try:
            check_manifest_path(rel_path, where=where)
        except ValueError as e:
            raise EngineError(f"{e}; {hint}") from None
        # Other keys of an entry are ignored (as every kiln so far has), so optional keys can be added
        # without a format version: "chunk_bytes"/"chunk_sha256" are read by this kiln, ignored by older ones.
        size = raw.get("size") if isinstance(raw, dict) else None
        sha256 = raw.get("sha256") if isinstance(raw, dict) else None
        valid_size = isinstance(size, int) and not isinstance(size, bool) and size >= 0
        if not (valid_size and is_sha256_hex(sha256)):
            raise EngineError(
                f'{where}[{rel_path!r}] must be {{"size": <bytes>, "sha256": <64 lowercase hex>}}, '
                f"got {raw!r:.200}; {hint}"
            )
        chunk_bytes, chunk_sha256 = raw.get("chunk_bytes"), raw.get("chunk_sha256")
        if problem := chunk_keys_problem(size, chunk_bytes, chunk_sha256):
            raise EngineError(f"{where}[{rel_path!r}] {problem}; {hint}")
        files[rel_path] = FileEntry(size=size, sha256=sha256, chunk_bytes=chunk_bytes,
                                    chunk_sha256=None if chunk_sha256 is None else tuple(chunk_sha256))
    return files


def check_manifest_path(rel_path: object, *, where: str) -> None:
    """Manifest paths are relative posix paths inside the engine (never engine.json itself)."""
    if not isinstance(rel_path, str) or not rel_path:
        raise ValueError(f"{where}: file path {rel_path!r} must be a non-empty string")
    parts = PurePosixPath(rel_path).parts
    if (
        rel_path.startswith("/")
        or "\\" in rel_path
        or ".." in parts
        or "." in parts
        or rel_path == ENGINE_JSON
    ):
        raise ValueError(
            f"{where}: file path {rel_path!r} must be a relative posix path inside the engine directory "
            f"other than {ENGINE_JSON}"
        )
