"""Writing a directory all at once: into a fresh staging directory beside it, moved into place at the end."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """Yields an empty directory beside `target` to fill. On success it replaces `target` (removed first);
    on any failure it is removed. Either way `target` is never left half-written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; a server may run as another user
        yield staging
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
