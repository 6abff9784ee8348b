"""The one place an engine core is assembled: `LLM`, `AsyncLLM` and the Triton model all call it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from kiln.engine_format import ENGINE_JSON, EngineError
from kiln.engine_format.config import KVCacheScales

from .device_support import check_device_supports
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


def kv_cache_scales(info: EngineInfo) -> KVCacheScales | None:
    """The engine's per-layer KV-cache scales (None for a float cache), checked against the model's layers:
    an EngineError naming engine.json when they do not match."""
    scales = info.config.build.kv_cache_scales
    layers = info.model_config.num_layers
    if scales is not None and len(scales) != layers:
        engine_dir = info.spec.engine_dir
        raise EngineError(f"{engine_dir / ENGINE_JSON}: build_config: kv_cache_scales has {len(scales)} "
                          f"[k_scale, v_scale] pairs but the model has {layers} layers; rebuild the engine "
                          f"with `kiln build --checkpoint ... --output {engine_dir}`")
    return scales


def create_executor(info: EngineInfo, runtime: RuntimeConfig) -> Executor:
    """The executor for the engine's mapping: one rank here, in this process. Refuses, before allocating
    anything, an engine whose formats the device cannot run or whose KV-cache scales do not fit the model."""
    check_device_supports(info.config.build, runtime.device)
    scales = kv_cache_scales(info)
    mapping = info.config.mapping
    if mapping.tp_size > 1:
        raise EngineError(f"engine {info.spec.engine_dir} is split over tp_size={mapping.tp_size} ranks; this kiln "
                          f"runs single-rank engines only: rebuild it without --tp-size")
    return LocalExecutor(load_network(info, runtime.device), runtime, scales)


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
    check_device_supports(loaded.config.build, runtime.device)
    return LLMEngine(loaded, runtime, LocalExecutor(loaded.model, runtime, kv_cache_scales(loaded)))
