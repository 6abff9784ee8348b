"""Stamps of engine files whose sha256 matched the manifest, so a restart need not hash them again.

A stamp records what a file looked like on disk (size, mtime, ctime, inode, device) when its contents
hashed to the manifest's sha256. The next load trusts an unchanged file without reading it; any
difference, or a different expected hash, means the file is hashed again.

Stamps live outside the engine directory (the engine may be read-only or shared between users): one
JSON file per engine, named by a hash of the engine's absolute path, in `$KILN_CACHE_DIR/verified/`,
else `$XDG_CACHE_HOME/kiln/verified/`, else `~/.cache/kiln/verified/`. The cache is only a shortcut:
when it cannot be read or written, loading goes on and hashes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

logger = logging.getLogger("kiln.engine_format")

_STAMPS_VERSION = 1


@dataclass(frozen=True)
class FileStamp:
    """One file as it was when its contents hashed to `sha256`. ctime is included because, unlike mtime,
    it cannot be set back by hand: a file rewritten and given its old mtime is still hashed again."""

    path: str  # absolute
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int
    sha256: str  # the manifest's hash that the contents matched

    @classmethod
    def of(cls, path: Path, st: os.stat_result, sha256: str) -> FileStamp:
        return cls(path=str(path), size=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns,
                   inode=st.st_ino, device=st.st_dev, sha256=sha256)

    def vouches_for(self, path: Path, st: os.stat_result, expected_sha256: str) -> bool:
        """Whether this stamp shows that `path`, now `st`, still holds contents hashing to `expected_sha256`."""
        return self == FileStamp.of(path, st, expected_sha256)


def stamp_dir() -> Path:
    """Where stamp files go: `$KILN_CACHE_DIR/verified`, `$XDG_CACHE_HOME/kiln/verified` or
    `~/.cache/kiln/verified`."""
    if os.environ.get("KILN_CACHE_DIR"):
        return Path(os.environ["KILN_CACHE_DIR"]) / "verified"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "kiln" / "verified"
    return Path.home() / ".cache" / "kiln" / "verified"


def stamp_file(engine_dir: Path) -> Path:
    """The stamp file of the engine at `engine_dir`; symlinks are resolved, so every path to one engine
    shares its stamps."""
    key = hashlib.sha256(str(engine_dir.resolve()).encode()).hexdigest()[:32]
    return stamp_dir() / f"{key}.json"


def load_stamps(engine_dir: Path) -> dict[str, FileStamp]:
    """The stamps recorded for `engine_dir`, by manifest path; {} when there are none or they are unreadable."""
    path = stamp_file(engine_dir)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        if document.get("version") != _STAMPS_VERSION:
            return {}
        names = {f.name for f in fields(FileStamp)}
        return {rel: FileStamp(**raw) for rel, raw in document["files"].items() if set(raw) == names}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        # A damaged stamp file only costs a re-hash; it is rewritten after this load.
        logger.debug("ignoring unreadable verification stamps %s: %s", path, e)
        return {}


def save_stamps(engine_dir: Path, stamps: dict[str, FileStamp]) -> None:
    """Records `stamps` for `engine_dir`, replacing what was there, atomically (a concurrent load reads the
    old or the new file, never half of one). Failures are logged at debug level and otherwise ignored."""
    path = stamp_file(engine_dir)
    document = {"version": _STAMPS_VERSION, "engine_dir": str(engine_dir.resolve()),
                "files": {rel: asdict(stamp) for rel, stamp in sorted(stamps.items())}}
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1)
        os.replace(tmp_name, path)
    except OSError as e:
        if tmp_name is not None:
            Path(tmp_name).unlink(missing_ok=True)
        logger.debug("cannot record verification stamps in %s (the next load hashes again): %s", path, e)
