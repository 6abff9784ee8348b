"""Ranks 1..N-1 of a tensor-parallel engine: start like rank 0, then run each step rank 0 sends until it
says stop (and read each LoRA adapter it names, `lora_sync.py`). They sample nothing: rank 0 owns the
scheduler, block manager and sampler."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from kiln.runtime.distributed.channel import PipeReceiver
from kiln.runtime.distributed.group import RankGroups
from kiln.runtime.distributed.launch import RankLaunch
from kiln.runtime.distributed.lora_sync import apply_on_worker
from kiln.runtime.distributed.rank import join, rank_runtime, start_runner
from kiln.runtime.distributed.step_codec import StepDecoder
from kiln.runtime.worker.engine_loader import RuntimeConfig, engine_info, open_engine_spec
from kiln.runtime.worker.heap import freeze_startup_heap
from kiln.runtime.worker.model_step import StepInput

logger = logging.getLogger("kiln.runtime")

# How often a worker checks that rank 0 is still there (a collective waiting on a dead NCCL peer never returns).
LIVENESS_PERIOD_S = 1.0


def run_worker(engine_dir: str | Path, runtime: RuntimeConfig, launch: RankLaunch,
               kv_cache_scales: Sequence[tuple[float, float]] | None, steps: PipeReceiver | None = None) -> NoReturn:
    """A worker rank's whole life: the process ends (exit 0) when rank 0 stops the engine, without the
    interpreter's teardown, which would race the groups' native threads. Any failure is posted for rank 0
    to report (naming this rank and the cause) and ends this process at once (exit 1): the collectives it
    would leave waiting end with it. `steps`: where rank 0's steps come from when it started this process
    (its stdin); None under a launcher (they come over gloo)."""
    groups: RankGroups | None = None
    try:
        runtime = rank_runtime(runtime, launch, engine_dir)
        groups = join(runtime, launch)
        # Rank 0 checks every file's sha256 (in the background, before its engine serves), and only it
        # detokenizes.
        info = engine_info(open_engine_spec(engine_dir, sha256_by_caller=True), tokenizer=False)
        runner = start_runner(info, runtime, groups, kv_cache_scales)
        freeze_startup_heap()  # as rank 0 does when ready: the collector's full passes skip what startup made
        _watch_rank0(groups)
        receive = groups.receive_step if steps is None else steps.receive
        decoder = StepDecoder()  # checks every message against the step schema (never unpickles)
        while (message := decoder.decode(receive())) is not None:
            if isinstance(message, StepInput):
                runner.execute(message)
            else:  # a LoRA adapter to hold or ones to forget; a refusal is rank 0's to report
                apply_on_worker(runner.lora, message, groups.gather_texts)
        runner.release_graphs()
    except BaseException as e:  # every failure ends the rank; what matters is that rank 0 hears why
        _die(groups, launch.rank, e)
    groups.destroy()
    groups.say_stopped()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_process_main(engine_dir: str, runtime: RuntimeConfig, launch: RankLaunch,
                        kv_cache_scales: Sequence[tuple[float, float]] | None, log_level: int, *,
                        steps: PipeReceiver) -> None:
    """A worker process that rank 0 started on this machine (`worker_main`)."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s rank{launch.rank} %(levelname)s %(message)s")
    run_worker(engine_dir, runtime, launch, kv_cache_scales, steps)


def _die(groups: RankGroups | None, rank: int, error: BaseException) -> None:
    message = f"{type(error).__name__}: {error}".strip()
    if groups is None:  # failed before joining: no store to post to; the exit code and stderr say it
        traceback.print_exception(error)
    else:
        groups.post_error(message)
    logger.error("rank %d failed: %s", rank, message)
    os._exit(1)


def _watch_rank0(groups: RankGroups) -> None:
    """Ends this process when rank 0 is gone (it hosts the store), even while a collective waits for it."""
    def watch() -> None:
        while groups.rank0_alive():
            time.sleep(LIVENESS_PERIOD_S)
        logger.error("rank %d: rank 0 is gone; exiting", groups.rank)
        os._exit(1)

    threading.Thread(target=watch, name="kiln-rank0-watch", daemon=True).start()
