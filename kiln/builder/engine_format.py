"""Moved to `kiln.engine_format` (shared by builder and runtime); these names stay importable from here."""

from kiln.engine_format import (  # noqa: F401
    ENGINE_FORMAT_VERSION,
    ENGINE_JSON,
    EngineError,
    EngineSpec,
    FileEntry,
    file_entry,
    load_engine_spec,
    rank_file_name,
    write_engine_json,
)
