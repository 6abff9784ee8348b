"""The one place an engine core is assembled: `LLM`, `AsyncLLM` and the Triton model all call it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from kiln.engine_format import EngineError

from .engine import LLMEngine
from .engine_loader import (
    EngineInfo,
    LoadedEngine,
    RuntimeConfig,
    load_engine_info,
    load_network,
    resolve_runtime,
)
from .executor import Executor, LocalExecutor

logger = logging.getLogger("kiln.runtime")


def create_executor(info: EngineInfo, runtime: RuntimeConfig) -> Executor:
    """The executor for the engine's mapping: one rank here, in this process."""
    mapping = info.config.mapping
    if mapping.tp_size > 1:
        raise EngineError(f"engine {info.spec.engine_dir} is split over tp_size={mapping.tp_size} ranks; this kiln "
                          f"runs single-rank engines only: rebuild it without --tp-size")
    return LocalExecutor(load_network(info, runtime.device), runtime)


def create_engine(engine_dir: str | Path, *, verify_checksums: bool = True, **runtime_options) -> LLMEngine:
    """Loads an engine directory and assembles its engine core. `runtime_options` are those of
    `engine_loader.resolve_runtime` (device, lower limits, KV-cache size, CUDA graphs); every failure is an
    EngineError or ValueError naming what to change."""
    start = time.perf_counter()
    info = load_engine_info(engine_dir, verify_checksums=verify_checksums)
    runtime = resolve_runtime(info, **runtime_options)
    engine = LLMEngine(info, runtime, create_executor(info, runtime))
    logger.info("engine %s (%s, %s, %s) ready in %.2fs", info.spec.engine_dir, info.spec.architecture,
                info.config.build.dtype, runtime.device, time.perf_counter() - start)
    return engine


def engine_from_loaded(loaded: LoadedEngine, runtime: RuntimeConfig) -> LLMEngine:
    """An engine core over a network already loaded in this process (several engines may share one)."""
    return LLMEngine(loaded, runtime, LocalExecutor(loaded.model, runtime))
