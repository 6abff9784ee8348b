"""The engine directory format, shared by the builder (which writes it) and the runtime (which reads it).

`spec` reads and writes engine.json, `manifest` parses the files it lists (`chunks`: per-chunk sha256s of
large files) and `verify` checks them (sizes, and sha256 trusted through `stamps` once matched), `config`
types its build_config and `mapping` its rank layout, `limits` bounds the build limits (for the builder's flags and engine.json alike),
`json_fields` checks a JSON object against the dataclass it becomes, and `ownership` says whether a
directory is an engine that a build may replace; `staging` (with `build_owner`) writes a directory all at once
(engines, and serve's Triton repositories). The runtime imports this package, never the builder.
"""

from .config import ENGINE_DTYPES, EngineBuildConfig, EngineConfig, read_engine_config
from .errors import EngineError
from .json_fields import check_json_fields
from .manifest import ENGINE_JSON, FileEntry, file_entry
from .mapping import Mapping
from .spec import (
    ENGINE_FORMAT_VERSION,
    QUANTIZED_FORMAT_VERSION,
    TOKENIZER_DIR,
    EngineSpec,
    load_engine_spec,
    rank_file_name,
    write_engine_json,
)

__all__ = ["ENGINE_DTYPES", "ENGINE_FORMAT_VERSION", "ENGINE_JSON", "QUANTIZED_FORMAT_VERSION", "TOKENIZER_DIR",
           "EngineBuildConfig", "EngineConfig", "EngineError", "EngineSpec", "FileEntry", "Mapping", "check_json_fields", "file_entry",
           "load_engine_spec", "rank_file_name", "read_engine_config", "write_engine_json"]
