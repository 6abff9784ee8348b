"""The engine directory on disk: engine.json, its file manifest, and the checks made when loading it.

An engine directory holds `engine.json`, `rank<N>.safetensors` (one per rank) and `tokenizer/`.
engine.json records how the engine was built and lists every other file with its size and sha256,
so a truncated copy or a half-finished build is caught at load time instead of as garbage output.
Checking the target (GPU, torch version) against the running machine is done elsewhere.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import EngineError
from .manifest import ENGINE_JSON, FileEntry, check_manifest_path, parse_manifest
from .verify import check_files

# Version 2: quantized weights and KV caches (build_config.quantization, kv_cache_dtype fp8/int8,
# kv_cache_scales), which a version-1 reader would misread. A build writes the lowest version that holds
# its engine, so full-precision engines stay readable by older kilns.
ENGINE_FORMAT_VERSION = 2
QUANTIZED_FORMAT_VERSION = 2
TOKENIZER_DIR = "tokenizer"

_REBUILD_HINT = "rebuild the engine with `kiln build --checkpoint ... --output {engine_dir}`"

# Top-level engine.json fields in the order they are written, with the JSON type each must have.
_FIELDS: dict[str, type] = {
    "format_version": int,
    "kiln_version": str,
    "architecture": str,
    "model_config": dict,
    "build_config": dict,
    "mapping": dict,
    "target": dict,
    "files": dict,
}


@dataclass(frozen=True)
class EngineSpec:
    """The contents of a validated engine.json; paths in `files` are relative posix paths."""

    engine_dir: Path
    format_version: int
    kiln_version: str
    architecture: str
    model_config: dict  # normalized model config, plain JSON data
    build_config: dict  # dtype, max_batch_size, max_num_tokens, max_seq_len, kv_block_size, quantization, kv_cache_dtype
    mapping: dict  # {"tp_size": int, "num_ranks": int}
    target: dict  # device_type, gpu_name, compute_capability, torch_version, triton_version, kernel_settings
    files: dict[str, FileEntry]

    @property
    def num_ranks(self) -> int:
        return self.mapping["num_ranks"]

    def rank_file(self, rank: int) -> Path:
        """The weight file of `rank` (0 <= rank < num_ranks)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(
                f"rank {rank} is out of range: engine {self.engine_dir} has {self.num_ranks} rank(s)"
            )
        return self.engine_dir / rank_file_name(rank)

    @property
    def tokenizer_dir(self) -> Path | None:
        """The engine's tokenizer folder, or None when the engine was built without tokenizer files."""
        prefix = TOKENIZER_DIR + "/"
        if any(path.startswith(prefix) for path in self.files):
            return self.engine_dir / TOKENIZER_DIR
        return None


def rank_file_name(rank: int) -> str:
    """The manifest path of rank `rank`'s weights."""
    return f"rank{rank}.safetensors"


def write_engine_json(
    engine_dir: str | Path,
    *,
    architecture: str,
    model_config: dict,
    build_config: dict,
    mapping: dict,
    target: dict,
    files: dict[str, FileEntry],
    kiln_version: str,
    format_version: int = 1,
) -> Path:
    """Write `<engine_dir>/engine.json` atomically and return its path.

    Written last by a build: its presence marks a finished engine, so it goes to a temporary file
    that is renamed into place. Top-level keys keep a fixed order and nested keys are sorted, so the
    same build gives the same bytes. `format_version` is the lowest version that describes the engine.
    """
    if not 1 <= format_version <= ENGINE_FORMAT_VERSION:
        raise ValueError(f"format_version={format_version} must be 1..{ENGINE_FORMAT_VERSION}")
    engine_dir = Path(engine_dir)
    for path, entry in files.items():
        check_manifest_path(path, where="write_engine_json files")
        if not isinstance(entry, FileEntry):
            raise TypeError(
                f"write_engine_json files[{path!r}] is a {type(entry).__name__}, expected FileEntry"
            )
    document = {
        "format_version": format_version,
        "kiln_version": kiln_version,
        "architecture": architecture,
        "model_config": model_config,
        "build_config": build_config,
        "mapping": mapping,
        "target": target,
        "files": {p: e.to_json() for p, e in sorted(files.items())},
    }
    for field, expected in _FIELDS.items():
        if not isinstance(document[field], expected):
            raise TypeError(
                f"engine.json field {field!r} must be {expected.__name__}, got {document[field]!r}"
            )
    try:
        text = json.dumps({k: _sort_nested(v) for k, v in document.items()}, indent=2, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"engine.json for {engine_dir} must hold plain JSON data: {e}") from e

    target_path = engine_dir / ENGINE_JSON
    fd, tmp_name = tempfile.mkstemp(prefix=ENGINE_JSON + ".", suffix=".tmp", dir=engine_dir)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it private; a server may run as another user than the build
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, target_path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target_path


def load_engine_spec(engine_dir: str | Path, *, verify_checksums: bool = True,
                     sha256_by_caller: bool = False) -> EngineSpec:
    """Read and validate engine.json and check every manifest file's size and, unless `verify_checksums`
    is False, its sha256. `sha256_by_caller`: sizes only; the caller verifies the hashes itself with
    `verify.start_verification(spec.engine_dir, spec.files)` before it uses the engine.

    Raises EngineError naming what is wrong and what to do about it. A file whose hash matched is
    stamped outside the engine (`stamps`) and not hashed again while it is unchanged, so only the first
    load of an engine version pays for reading its weights twice.
    """
    engine_dir = Path(engine_dir)
    hint = _REBUILD_HINT.format(engine_dir=engine_dir)
    if not engine_dir.is_dir():
        raise EngineError(
            f"engine directory {engine_dir} does not exist; build one with "
            f"`kiln build --checkpoint ... --output {engine_dir}`"
        )
    document = _read_engine_json(engine_dir, hint)
    _check_format_version(engine_dir, document)
    for field, expected in _FIELDS.items():
        _check_field(engine_dir, document, field, expected, hint)
    mapping = _parse_mapping(engine_dir, document["mapping"], hint)
    files = parse_manifest(engine_dir, document["files"], hint)
    # An engine whose dummy weights are drawn at load has no rank files.
    weightless = document["build_config"].get("weights_at_load") is True
    for rank in range(0 if weightless else mapping["num_ranks"]):
        if rank_file_name(rank) not in files:
            raise EngineError(
                f"{engine_dir / ENGINE_JSON}: mapping.num_ranks is {mapping['num_ranks']} but the manifest "
                f"lists no {rank_file_name(rank)}; {hint}"
            )
    check_files(engine_dir, files, verify_checksums, sha256_by_caller=sha256_by_caller)
    return EngineSpec(
        engine_dir=engine_dir,
        format_version=document["format_version"],
        kiln_version=document["kiln_version"],
        architecture=document["architecture"],
        model_config=document["model_config"],
        build_config=document["build_config"],
        mapping=mapping,
        target=document["target"],
        files=files,
    )


# -- validation helpers -----------------------------------------------------------------------------


def _read_engine_json(engine_dir: Path, hint: str) -> dict[str, Any]:
    path = engine_dir / ENGINE_JSON
    if not path.is_file():
        raise EngineError(
            f"{engine_dir} has no {ENGINE_JSON}: it is not a kiln engine, or its build did not finish; {hint}"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EngineError(f"cannot read {path}: {e}; check its permissions, or {hint}") from e
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise EngineError(
            f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos}); "
            f"the file is damaged: {hint}"
        ) from e
    if not isinstance(document, dict):
        raise EngineError(f"{path} must hold a JSON object, found {type(document).__name__}; {hint}")
    return document


def _check_format_version(engine_dir: Path, document: dict[str, Any]) -> None:
    # Checked before the other fields: a newer format may legitimately lack or rename them.
    path = engine_dir / ENGINE_JSON
    version = document.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise EngineError(
            f"{path}: field 'format_version' must be an integer, got {version!r}; "
            f"{_REBUILD_HINT.format(engine_dir=engine_dir)}"
        )
    if version > ENGINE_FORMAT_VERSION:
        written_by = document.get("kiln_version")
        written_by = written_by if isinstance(written_by, str) else "(unknown version)"
        raise EngineError(
            f"{path}: engine format version {version} was written by kiln {written_by}; this kiln "
            f"{_running_kiln_version()} reads versions up to {ENGINE_FORMAT_VERSION}: upgrade kiln or rebuild the engine"
        )
    if version < 1:
        raise EngineError(
            f"{path}: engine format version {version} is invalid (expected 1..{ENGINE_FORMAT_VERSION}); "
            f"{_REBUILD_HINT.format(engine_dir=engine_dir)}"
        )


def _check_field(engine_dir: Path, document: dict[str, Any], field: str, expected: type, hint: str) -> None:
    path = engine_dir / ENGINE_JSON
    if field not in document:
        raise EngineError(f"{path}: required field {field!r} is missing; {hint}")
    value = document[field]
    # bool is an int subclass in Python; JSON true is never a valid count.
    if isinstance(value, bool) or not isinstance(value, expected):
        raise EngineError(
            f"{path}: field {field!r} must be {_json_type_name(expected)}, got {_json_type_name(type(value))} "
            f"{value!r:.80}; {hint}"
        )


def _parse_mapping(engine_dir: Path, mapping: dict[str, Any], hint: str) -> dict[str, Any]:
    for key in ("tp_size", "num_ranks"):
        value = mapping.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EngineError(
                f"{engine_dir / ENGINE_JSON}: field 'mapping.{key}' must be a positive integer, got {value!r}; {hint}"
            )
    return mapping


def _sort_nested(value: Any) -> Any:
    """`value` with every dict's keys sorted, so the JSON text does not depend on insertion order."""
    if isinstance(value, dict):
        return {k: _sort_nested(value[k]) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_sort_nested(v) for v in value]
    return value


def _json_type_name(python_type: type) -> str:
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "a boolean",
        type(None): "null",
    }
    return names.get(python_type, python_type.__name__)


def _running_kiln_version() -> str:
    # Imported here, not at module level, so this module never depends on kiln/__init__'s import order.
    from .. import __version__

    return __version__
