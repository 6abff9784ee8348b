"""The engine directory format, shared by the builder (which writes it) and the runtime (which reads it).

`spec` reads and writes engine.json, `manifest` checks the files it lists, `config` types its
build_config and `mapping` its rank layout. The runtime imports this package, never the builder.
"""

from .config import ENGINE_DTYPES, EngineBuildConfig, EngineConfig, read_engine_config
from .errors import EngineError
from .manifest import ENGINE_JSON, FileEntry, file_entry
from .mapping import Mapping
from .spec import (
    ENGINE_FORMAT_VERSION,
    TOKENIZER_DIR,
    EngineSpec,
    load_engine_spec,
    rank_file_name,
    write_engine_json,
)

__all__ = ["ENGINE_DTYPES", "ENGINE_FORMAT_VERSION", "ENGINE_JSON", "TOKENIZER_DIR", "EngineBuildConfig",
           "EngineConfig", "EngineError", "EngineSpec", "FileEntry", "Mapping", "file_entry", "load_engine_spec",
           "rank_file_name", "read_engine_config", "write_engine_json"]
