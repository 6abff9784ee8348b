"""The engine's file manifest: every file with its size and sha256, parsed and validated (`verify` checks files)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import EngineError

ENGINE_JSON = "engine.json"
_HASH_CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class FileEntry:
    """One manifest entry: the file's size in bytes and the sha256 hex digest of its contents."""

    size: int
    sha256: str


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
        size = raw.get("size") if isinstance(raw, dict) else None
        sha256 = raw.get("sha256") if isinstance(raw, dict) else None
        valid_size = isinstance(size, int) and not isinstance(size, bool) and size >= 0
        valid_sha = (
            isinstance(sha256, str) and len(sha256) == 64 and all(c in "0123456789abcdef" for c in sha256)
        )
        if not (valid_size and valid_sha):
            raise EngineError(
                f'{where}[{rel_path!r}] must be {{"size": <bytes>, "sha256": <64 lowercase hex>}}, '
                f"got {raw!r:.200}; {hint}"
            )
        files[rel_path] = FileEntry(size=size, sha256=sha256)
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
