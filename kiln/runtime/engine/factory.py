"""The one place an engine core is assembled: `LLM`, `AsyncLLM` and the Triton model all call it."""

from __future__ import annotations

import logging
import time
import weakref
from pathlib import Path

from kiln.engine_format import ENGINE_JSON, EngineError
from kiln.engine_format.config import KVCacheScales
from kiln.engine_format.verify import Verification, format_bytes, manifest_error, start_verification
from kiln.runtime.distributed import TPExecutor, launch_from_env
from kiln.runtime.distributed.launch import local_launch
from kiln.runtime.distributed.worker import run_worker
from kiln.runtime.engine.engine import LLMEngine
from kiln.runtime.engine.startup_log import StartupLog
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.speculative.speculator import Speculator, make_speculator, speculation_runtime
from kiln.runtime.worker.device_support import check_device_supports
from kiln.runtime.worker.engine_loader import (
    EngineInfo,
    LoadedEngine,
    RuntimeConfig,
    engine_info,
    load_network,
    open_engine_spec,
    resolve_runtime,
)
from kiln.runtime.worker.executor import Executor, LocalExecutor
from kiln.runtime.worker.heap import freeze_startup_heap
from kiln.runtime.worker.kernel_store import install_engine_kernels

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


def create_executor(info: EngineInfo, runtime: RuntimeConfig, startup: StartupLog | None = None) -> Executor:
    """The executor for the engine's mapping: one rank in this process, or rank 0 of a tensor-parallel
    engine (which starts the other ranks, unless a launcher such as torchrun started them). Refuses, before
    allocating anything, an engine whose formats the device cannot run or whose KV-cache scales do not fit
    the model. Under a launcher, a process of rank > 0 runs its rank's steps here until rank 0 stops the
    engine, then exits: the others only run steps. `startup` gets the stages' times."""
    startup = startup if startup is not None else StartupLog()
    check_device_supports(info.config.build, runtime.device)
    scales = kv_cache_scales(info)
    tp_size = info.config.mapping.tp_size
    try:
        launch = launch_from_env()
    except ValueError as e:
        raise EngineError(str(e)) from None
    # Before the first kernel launch (the ranks' load_network installs them too: once per process).
    kernels = install_engine_kernels(info.spec, runtime.device)
    startup.add("kernels", kernels.seconds, kernels.describe())
    if tp_size == 1:
        with startup.stage("weights"):
            model = load_network(info, runtime.device)
        start = time.perf_counter()
        executor = LocalExecutor(model, runtime, scales)
        startup.add("profile+allocate", time.perf_counter() - start - executor.graph_capture_seconds)
        startup.add("graphs", executor.graph_capture_seconds)
        return executor
    if launch is None:
        launch = local_launch(tp_size)
    elif launch.world_size != tp_size:
        raise EngineError(f"engine {info.spec.engine_dir} is split over tp_size={tp_size} ranks but the launcher "
                          f"started WORLD_SIZE={launch.world_size} processes: start {tp_size} (torchrun "
                          f"--nnodes ... --nproc-per-node ...), or rebuild with --tp-size {launch.world_size}")
    if launch.rank != 0:
        run_worker(info.spec.engine_dir, runtime, launch, scales)  # never returns: the process ends with the engine
    with startup.stage("ranks (weights, allocate, graphs)"):
        return TPExecutor(info, runtime, scales, launch)


def create_engine(engine_dir: str | Path, options: RuntimeOptions | None = None) -> LLMEngine:
    """Loads an engine directory and assembles its engine core, run as `options` say (device, lower limits,
    KV-cache size, CUDA graphs; `speculative_config`: the proposer, a draft engine loaded on the same device or
    n-gram lookup; None: the defaults). Every failure is an EngineError or ValueError naming what to change.

    With `verify_checksums` (the default) the files' sha256 are hashed in background threads while the
    weights load and the graphs are captured; the engine is returned only after every file matched. A file
    that does not match fails with the EngineError a check before loading gives, and what was loaded is
    released; so does a failure while loading that a damaged file explains."""
    options = options if options is not None else RuntimeOptions()
    verify_checksums = options.verify_checksums
    start = time.perf_counter()
    startup = StartupLog()
    speculative = options.speculative_config
    verification: Verification | None = None
    executor: Executor | None = None
    speculator: Speculator | None = None
    try:
        with startup.stage("load"):
            spec = open_engine_spec(engine_dir, verify_checksums=verify_checksums, sha256_by_caller=verify_checksums)
            if verify_checksums and not _launched_as_worker_rank():
                verification = start_verification(spec.engine_dir, spec.files)
            info = engine_info(spec)
            runtime = resolve_runtime(info, options)
            if speculative is not None:  # before the runner captures its graphs: verify steps' shapes
                runtime = speculation_runtime(speculative, info, runtime)
        executor = create_executor(info, runtime, startup)
        if speculative is not None:
            speculator = make_speculator(speculative, info, runtime, create_executor=create_executor,
                                         verify_checksums=verify_checksums, target_executor=executor)
        finish_verification(verification, startup)
    except BaseException as error:
        if executor is not None:
            release_executor(executor, speculator)
        executor = speculator = None  # the traceback keeps this frame: let the network go now
        settle_verification(verification, error)
        raise
    try:
        engine = LLMEngine(info, runtime, executor, speculator)
    except BaseException:
        release_executor(executor, speculator)
        raise
    # An engine dropped without shutdown() (a notebook's `del llm`) still stops a tensor-parallel engine's
    # ranks and leaves its groups: on the engine, not the executor, whose watcher thread keeps it alive.
    weakref.finalize(engine, release_executor, executor, speculator)
    freeze_startup_heap()  # the collector's full passes would otherwise walk all of it under load (heap.py)
    logger.info("engine %s (%s, %s, %s) ready in %.2fs: %s", info.spec.engine_dir, info.spec.architecture,
                info.config.build.dtype, runtime.device, time.perf_counter() - start, startup.summary())
    return engine


def _launched_as_worker_rank() -> bool:
    """Whether a launcher (torchrun) started this process as a rank > 0, which only runs steps: rank 0
    verifies every rank's files."""
    try:
        launch = launch_from_env()
    except ValueError:  # create_executor says what is wrong
        return False
    return launch is not None and launch.rank != 0


def finish_verification(verification: Verification | None, startup: StartupLog) -> None:
    """Waits for the background sha256 checks, adds their stage to `startup` (the seconds they added to the
    startup: those beyond the stages they ran beside) and raises the manifest's EngineError on a mismatch."""
    if verification is None:
        startup.add("verify", 0.0, "sha256 skipped: verify_checksums=False")
        return
    problems = verification.wait()
    hashed = len(verification.to_hash)
    trusted = len(verification.files) - hashed
    note = (f"sha256 of {hashed} file(s), {format_bytes(verification.bytes_hashed)}, in "
            f"{verification.seconds:.2f}s beside loading; {trusted} trusted by stamp") if hashed else \
        f"{trusted} file(s) trusted by stamp"
    startup.add("verify (overlapped)", verification.waited, note)
    if problems:
        raise manifest_error(verification.engine_dir, problems)


def settle_verification(verification: Verification | None, error: BaseException) -> None:
    """After `error` stopped an engine's startup: an interrupt stops the hashing at once; any other failure
    waits for it, and a file that does not match the manifest is raised in its place (a damaged weight file
    shows as a parse error or a shape mismatch while loading; the manifest's error says what to do)."""
    if verification is None or verification.done:
        return
    if not isinstance(error, Exception):
        verification.cancel()
        return
    problems = verification.wait()
    if problems:
        raise manifest_error(verification.engine_dir, problems) from error


def release_executor(executor: Executor, speculator: Speculator | None = None) -> None:
    """What a dropped engine's finalizer does: stops the draft's ranks and the engine's (both idempotent, so an
    engine shut down already costs nothing)."""
    try:
        if speculator is not None:
            speculator.shutdown()
    finally:
        executor.shutdown()


def engine_from_loaded(loaded: LoadedEngine, runtime: RuntimeConfig) -> LLMEngine:
    """An engine core over a network already loaded in this process (several engines may share one);
    single-rank engines only."""
    check_device_supports(loaded.config.build, runtime.device)
    if loaded.config.mapping.tp_size > 1:
        raise EngineError(f"engine {loaded.spec.engine_dir} has tp_size={loaded.config.mapping.tp_size} ranks: "
                          f"load it with create_engine (kiln.runtime.LLM), which starts them")
    return LLMEngine(loaded, runtime, LocalExecutor(loaded.model, runtime, kv_cache_scales(loaded)))
