"""The engine's file manifest: every file with its size and sha256, and the checks made against it."""

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
    """Size and sha256 of a file, read in 1 MiB chunks so memory stays flat for any file size."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
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


def check_files(engine_dir: Path, files: dict[str, FileEntry], verify_checksums: bool) -> None:
    """Every manifest file exists with its recorded size (and hash); all problems are reported at once."""
    problems: list[str] = []
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
        if verify_checksums and file_entry(path).sha256 != entry.sha256:
            problems.append(
                f"{rel_path} has sha256 that differs from the manifest's {entry.sha256}: modified or corrupt"
            )
    if problems:
        raise EngineError(
            f"engine directory {engine_dir} does not match its manifest:\n  "
            + "\n  ".join(problems)
            + "\nthe engine files are truncated or modified; rebuild the engine "
            f"(`kiln build --checkpoint ... --output {engine_dir}`) or copy it again completely"
        )
