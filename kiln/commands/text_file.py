"""A UTF-8 text file named by a flag, read with an error that names the flag and the problem."""

from __future__ import annotations

from pathlib import Path


def read_text_arg(path: str | Path, flag: str) -> str:
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a UTF-8 text file")
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file" if not path.exists() else f"{flag} {path}: not a regular file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text:
        raise ValueError(f"{flag} {path}: the file is empty")
    return text
