"""Whether a directory is a kiln engine that a new build may delete and replace.

`kiln build --output D` replaces D when it holds an older engine. A file named engine.json alone is no
proof: D could be someone's project folder. So D counts as an engine only if its engine.json reads as
one (a JSON object with format_version, kiln_version and files) and D holds nothing else but the files
that manifest lists, the tokenizer folder and rank weight files of an earlier build with more ranks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .manifest import ENGINE_JSON, check_manifest_path
from .spec import TOKENIZER_DIR

_STALE_RANK_FILE = re.compile(r"rank\d+\.safetensors")


def engine_manifest_paths(directory: Path) -> set[str]:
    """The paths that `directory`'s engine.json lists; ValueError saying why it is not a kiln engine's."""
    path = directory / ENGINE_JSON
    if path.is_symlink() or not path.is_file():
        raise ValueError("it is not a regular file")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"it cannot be read as JSON: {e}") from None
    keys = ("format_version", "kiln_version", "files")
    if not isinstance(document, dict) or not all(k in document for k in keys):
        raise ValueError(f"it lacks one of {', '.join(keys)}")
    if not isinstance(document["files"], dict):
        raise ValueError("its 'files' is not an object")
    for rel_path in document["files"]:
        check_manifest_path(rel_path, where="its 'files'")
    return set(document["files"])


def foreign_entries(directory: Path, manifest_paths: set[str], prefix: str = "") -> list[str]:
    """Entries under `directory` that an engine with `manifest_paths` would not hold: not engine.json, not
    listed, not in the tokenizer folder, not a rank weight file. A folder with nothing of the engine's in
    it is named once, with a trailing slash."""
    foreign: list[str] = []
    for entry in sorted(directory.iterdir()):
        rel_path = prefix + entry.name
        if entry.is_dir() and not entry.is_symlink():
            if rel_path == TOKENIZER_DIR:
                continue
            if any(p.startswith(rel_path + "/") for p in manifest_paths):
                foreign += foreign_entries(entry, manifest_paths, rel_path + "/")
            else:
                foreign.append(rel_path + "/")
        elif not (rel_path == ENGINE_JSON or rel_path in manifest_paths or _STALE_RANK_FILE.fullmatch(rel_path)):
            foreign.append(rel_path)
    return foreign
