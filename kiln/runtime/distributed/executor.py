"""Rank 0 of a tensor-parallel engine: the `Executor` the engine core talks to.

Each step it sends the plain-data `StepInput` to the other ranks, runs its own shard, and returns the
logits (gathered over ranks by the network's lm_head). It starts the other ranks itself unless a launcher
(torchrun) started them, and watches them: a rank that dies or fails ends the engine with an EngineError
naming the rank and the cause, within seconds, never a hang.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from kiln.checkpoints.lora_adapter import LoRAAdapter
from kiln.engine_format import EngineError
from kiln.runtime.core.lora_request import LoRARequest
from kiln.runtime.core.scheduler import SchedulerOutput
from kiln.runtime.distributed.channel import PipeSender
from kiln.runtime.distributed.group import RankGroups
from kiln.runtime.distributed.launch import RankLaunch, start_local_workers
from kiln.runtime.distributed.lora_sync import RankZeroLoRA
from kiln.runtime.distributed.rank import join, rank_runtime, start_runner
from kiln.runtime.distributed.step_codec import StepEncoder, encode_start
from kiln.runtime.distributed.store import SECRET_VARIABLE, launch_secret, new_secret
from kiln.runtime.worker.engine_loader import EngineInfo, RuntimeConfig
from kiln.runtime.worker.model_step import StepInput, StepResult

logger = logging.getLogger("kiln.runtime")

WATCH_PERIOD_S = 0.5
# After a rank's death, a step still running this long on rank 0 is stuck in a collective: exit.
STUCK_STEP_EXIT_S = 15.0
WORKER_STOP_TIMEOUT_S = 10.0


class TPExecutor:
    """`launch`: this process is rank 0 of it (`RankLaunch.external`: a launcher started the other ranks)."""

    def __init__(self, info: EngineInfo, runtime: RuntimeConfig,
                 kv_cache_scales: Sequence[tuple[float, float]] | None, launch: RankLaunch) -> None:
        self.launch = launch
        self.world_size = launch.world_size
        self.fault: str | None = None  # why the engine cannot run any more, once a rank has failed
        self.accepts_token_feed = False  # the other ranks could not read rank 0's sampled tokens
        self.groups: RankGroups | None = None
        self._processes = []
        self._pipes: PipeSender | None = None
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self._step_started: float | None = None
        self._encoder = StepEncoder()  # one for every rank: each decoder follows its block-table ledger
        # EAGLE-3: where rank 0's features of each step go (capture_hidden); None: none are kept.
        self._hidden_sink: Callable[[SchedulerOutput, torch.Tensor], None] | None = None
        engine_dir = info.spec.engine_dir
        # The ranks started here get a fresh secret; a launcher's must share one (refused across machines without).
        secret = launch_secret(launch) if launch.external else new_secret()
        self._threads = torch.get_num_threads()  # rank 0 shares this process: restored at shutdown
        own = rank_runtime(runtime, launch, engine_dir)  # refuses too few GPUs before starting anything
        if not launch.external:
            level = logging.getLogger("kiln").getEffectiveLevel()
            self._processes = start_local_workers(
                lambda r: encode_start(engine_dir, runtime, launch.for_rank(r), kv_cache_scales, level), launch,
                {SECRET_VARIABLE: secret})
        # Steps go down the started workers' stdin pipes; to a launcher's ranks over gloo.
        self._pipes = PipeSender([p.stdin for p in self._processes]) if self._processes else None
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        try:
            self.groups = self._join(own, secret)
            self._watch()
            self.runner = start_runner(info, own, self.groups, kv_cache_scales)
        except BaseException as e:
            error = EngineError(self._describe(e, "starting"))
            self.shutdown()
            raise error from e
        lora = self.runner.lora  # enable_lora: the ranks' adapters follow rank 0's (lora_sync.py)
        self._lora = None if lora is None else RankZeroLoRA(lora, self._send_bytes, self.groups.gather_texts)
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.num_host_kv_blocks = self.runner.num_host_kv_blocks  # equal on every rank (each its share)
        self.host_kv_tier = None  # rank 0's tier holds only its shard of each block
        self.memory_report = self.runner.memory_report
        self.graph_capture_seconds = self.runner.graph_capture_seconds

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the ranks this process started (1, 2, ...), empty under a launcher."""
        return [p.pid for p in self._processes]

    def execute(self, step: StepInput) -> StepResult:
        if self.fault is not None:
            raise EngineError(self.fault)
        self._step_started = time.monotonic()
        try:
            self._send(step)
            result = self.runner.execute(step)
        except Exception as e:
            raise EngineError(self._describe(e, "running a step")) from e
        finally:
            self._step_started = None
        if self._hidden_sink is not None and result.aux_hidden is not None:
            self._hidden_sink(step.schedule, result.aux_hidden)
        return result

    def capture_hidden(self, layers: tuple[int, ...], sink: Callable[[SchedulerOutput, torch.Tensor], None]) -> None:
        """As `LocalExecutor.capture_hidden`: every later step's residual streams entering `layers` ([T, 3H] for
        an EAGLE-3 head) go to `sink` with the step's schedule. Rank 0's runner alone hands them out (after each
        layer's all-reduce the residual stream is the same on every rank), but every rank captures them, so that
        all take the same path (graph or eager) through each step and their collectives match: the layers must
        be those every rank started with (`RuntimeConfig.feature_layers`, set by create_engine). ValueError
        otherwise."""
        if tuple(layers) != self.runner.limits.feature_layers:
            raise ValueError(f"feature layers {list(layers)}: the ranks started capturing "
                             f"{list(self.runner.limits.feature_layers)} (RuntimeConfig.feature_layers, which "
                             f"create_engine sets from the speculative config)")
        self.runner.capture_hidden(layers)
        self._hidden_sink = sink

    def add_lora(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Keeps the adapter `request` names on every rank, each its slice (`lora_sync.py`): `adapter`, already
        read, or read here on rank 0 when None and not held; the other ranks read it themselves the first time.
        A ValueError says why it cannot be served (naming the other ranks that refused it), and the engine goes
        on. Only on an executor made with enable_lora."""
        if self._lora is None:
            raise ValueError("a lora_request needs the engine started with enable_lora=True (--enable-lora)")
        if self.fault is not None:
            raise EngineError(self.fault)
        self._step_started = time.monotonic()  # the watcher's stuck-collective clock, as for a step
        try:
            self._lora.add(request, adapter)
        except ValueError:  # the adapter's refusal (rank 0's, or the others' gathered): the engine goes on
            raise
        except Exception as e:  # the channel or a collective failed: a rank is gone
            raise EngineError(self._describe(e, f"adding LoRA adapter {request.lora_name!r}")) from e
        finally:
            self._step_started = None

    def holds_lora(self, lora_int_id: int) -> bool:
        """Whether rank 0 has the adapter in host memory (safe from any thread)."""
        return self._lora is not None and self._lora.slots.holds(lora_int_id)

    def pin_lora(self, lora_int_id: int, pinned: bool) -> None:
        """A live request naming the (added) adapter arrives (True) or leaves (False): pinned adapters stay in
        rank 0's host memory, and so in the others' (what rank 0 evicts, they forget)."""
        slots = self._lora.slots
        if pinned:
            slots.pin(lora_int_id)
            return
        slots.unpin(lora_int_id)
        if self.fault is None and not self._closing.is_set():
            try:
                self._lora.sync_drops()
            except Exception as e:  # a rank is gone: the next step raises the fault this records
                logger.error("%s", self._describe(e, "dropping LoRA adapters"))

    def lora_stats(self) -> dict[str, int]:
        """Rank 0's `LoRASlots.stats` (every rank holds the same adapters)."""
        return self._lora.slots.stats()

    def shutdown(self) -> None:
        """Stops every rank: tells the others to stop, waits for the ones it started, leaves the groups."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            # Joined, not left running: a store call of a thread that outlives the interpreter aborts the process.
            self._watcher.join(5.0)
        stopped = False
        if self.groups is not None and self.fault is None:
            try:
                self._send(None)
                stopped = True
            except Exception as e:  # a rank is gone already; the others end when the group does
                logger.debug("stopping the ranks: %s", e)
        if self.groups is not None:
            if stopped:
                self.runner.release_graphs()
            # Every rank leaves its groups at the same time (NCCL's teardown waits for the peers), and rank 0
            # waits for the others to have left before its process may exit (its exit would abort theirs).
            self.groups.destroy()
            if stopped:
                self.groups.wait_stopped(WORKER_STOP_TIMEOUT_S)
        torch.set_num_threads(self._threads)
        if self._pipes is not None:
            self._pipes.close()
        for process in self._processes:
            try:
                process.wait(WORKER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _send(self, step: StepInput | None) -> None:
        """The next step (None: stop) to every other rank."""
        self._send_bytes(self._encoder.encode(step))

    def _send_bytes(self, data: bytes) -> None:
        """A message to every other rank, in order after the ones before it."""
        if self._pipes is not None:
            self._pipes.send(data)
        else:
            self.groups.send_step(data)

    # ---- faults --------------------------------------------------------------------------------
    def _join(self, runtime: RuntimeConfig, secret: str) -> RankGroups:
        """Meets the other ranks, in a thread so that a rank that dies while starting is noticed here
        instead of after the rendezvous times out."""
        box: dict[str, object] = {}

        def meet() -> None:
            try:
                box["groups"] = join(runtime, self.launch, secret)
            except BaseException as e:  # handed to the waiting thread
                box["error"] = e

        thread = threading.Thread(target=meet, name="kiln-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if thread.is_alive() and self._dead_processes():
                raise RuntimeError("a rank exited before the ranks met")
        if "error" in box:
            raise box["error"]
        return box["groups"]

    def _dead_processes(self) -> list[tuple[int, int, int]]:
        """(rank, pid, exit code) of started ranks that have exited."""
        return [(rank, p.pid, p.poll()) for rank, p in enumerate(self._processes, 1) if p.poll() is not None]

    def _describe(self, error: BaseException, doing: str) -> str:
        """What went wrong, naming the rank: what a failed rank posted, how a started one died, or rank 0's
        own error."""
        for process in self._processes:  # a rank that just died may not have been reaped yet
            try:
                process.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
        posted = {} if self.groups is None else self.groups.posted_errors()
        causes = [f"rank {rank} failed: {message}" for rank, message in sorted(posted.items())]
        causes += [f"rank {rank} (pid {pid}) {_exit_description(code)}"
                   for rank, pid, code in self._dead_processes() if rank not in posted]
        if not causes:
            causes = [f"rank 0 failed: {type(error).__name__}: {error}"]
        if self.fault is None:
            self.fault = (f"tensor-parallel engine ({self.world_size} ranks) stopped while {doing}: "
                          + "; ".join(causes))
        return self.fault

    def _watch(self) -> None:
        """Notices a rank that dies or posts an error, even while no step runs (the engine then refuses the
        next step); aborts a collective stuck on a dead NCCL peer, and exits when even that does not help."""
        def watch() -> None:
            while not self._closing.wait(WATCH_PERIOD_S) and self.fault is None:
                posted = self.groups.posted_errors() if self.launch.external else {}
                if self._dead_processes() or posted:
                    break
            if self._closing.is_set() or self.fault is not None:
                return
            message = self._describe(RuntimeError("a rank stopped"), "running")
            logger.error("%s", message)
            if self.groups.backend != "gloo":  # gloo's collectives fail by themselves when a peer's socket closes
                self.groups.abort()
            deadline = time.monotonic() + STUCK_STEP_EXIT_S
            while time.monotonic() < deadline:
                if self._step_started is None or self._closing.wait(WATCH_PERIOD_S):
                    return
            print(f"kiln: {message}; a step is stuck in a collective, exiting", file=sys.stderr, flush=True)
            os._exit(1)

        self._watcher = threading.Thread(target=watch, name="kiln-rank-watch", daemon=True)
        self._watcher.start()


def _exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code} (its output above says why)"


def _shutdown_at_exit(ref: weakref.ref) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()
