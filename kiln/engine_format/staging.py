"""Writing a directory all at once: into a fresh staging directory beside it, moved into place at the end.

Here, below both, because the builder writes engines this way and serve writes Triton model repositories."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .build_owner import claim, release, remove_stale_stagings


@contextmanager
def staged_directory(target: Path, check_replace: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """Yields a new directory beside `target` to fill (empty but for its owner file, which is gone again before
    it moves into place). On success it replaces `target`; on any failure it is removed. Either way `target`
    is never left half-written.

    `check_replace(target)` runs just before an existing `target` is replaced and may raise to keep it:
    checked then, not only before the work starts, because someone may put files there in the meantime.

    Staging directories of earlier builds of `target` that were killed are removed first, and this one is
    claimed for this process while it is filled (build_owner.py), so that a later build can tell.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_stagings(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    owner = None
    try:
        owner = claim(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; a server may run as another user
        yield staging
        release(staging, owner)
        if target.exists():
            if check_replace is not None:
                check_replace(target)
            _replace(target, staging)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if owner is not None and not owner.closed:
            owner.close()


def _replace(target: Path, staging: Path) -> None:
    # The old directory is moved aside before the new one moves in, and deleted only after: a crash in
    # between leaves the old one beside the target instead of neither.
    old = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.old")
    target.rename(old)
    try:
        staging.rename(target)
    except BaseException:
        old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)
