"""The engine thread of kiln's Triton model: admits submissions, steps the engine, hands each row's outputs
to its submission's sink.

Triton's Python backend is not asyncio: `execute` runs on Triton's thread and, in decoupled mode, returns at
once while the responses follow later. So one thread owns the LLMEngine here (as AsyncLLM's thread does for
the asyncio servers). Submissions arrive through a queue and join the running batch at the next step
(in-flight batching). Every step, a submission whose client cancelled is aborted, which frees its KV blocks.

When a request enters the engine follows TensorRT-LLM's batch scheduler policies:
- max_utilization: at once. When KV blocks run short, kiln's scheduler preempts the newest running request
  and recomputes it later (nothing is lost, but work is repeated).
- guaranteed_no_evict: in arrival order, once the KV blocks for the request's whole prompt + max_tokens fit
  beside those reserved by the requests already in the engine, so no request is ever preempted.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kiln.runtime.core.outputs import RequestOutput
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.engine.engine import LLMEngine, Prompt
from kiln.serve.guided_request import TRITON_GUIDE_LABEL, refusal_message

logger = logging.getLogger("kiln.serve")

_STOP = object()
UNLOADING = "the model is being unloaded"


class Sink(Protocol):
    """Where one submission's results go. Called on the engine thread only. A submission ends with exactly
    one of: `update` of its last unfinished row with a finished output, `reject`, or `abort`."""

    def cancelled(self) -> bool:
        """The client went away: the submission is aborted (and `abort(None)` called)."""

    def update(self, row: int, output: RequestOutput) -> None:
        """Row `row` advanced; `output` is cumulative (the runtime's RequestOutput)."""

    def reject(self, message: str) -> None:
        """The submission is invalid (prompt too long, ...); none of its rows ran."""

    def abort(self, message: str | None) -> None:
        """The submission was stopped: cancelled (message None), or the loop is stopping (why)."""

    def fail(self, message: str, client_error: bool) -> None:
        """A row failed alone once running (runtime/core/request_failure.py): its constraint led nowhere
        (`client_error`) or kiln failed it; the submission's other rows were stopped."""


@dataclass(eq=False)
class _Submission:
    sink: Sink
    token_ids: list[list[int]]  # per row
    params: list[SamplingParams]  # per row
    blocks: list[int]  # per row: the KV blocks its prompt + max_tokens may take
    running: dict[str, int] = field(default_factory=dict)  # engine request id -> row
    num_pending: int = 0  # rows not yet in the engine

    @property
    def done(self) -> bool:
        return not self.running and self.num_pending == 0


class EngineLoop:
    """Owns `engine` from now on: only the loop's thread touches it (kv_cache_stats reads plain counters
    and is safe from any thread)."""

    def __init__(self, engine: LLMEngine, batch_scheduler_policy: str = "max_utilization") -> None:
        if batch_scheduler_policy not in ("max_utilization", "guaranteed_no_evict"):
            raise ValueError(f"unknown batch_scheduler_policy {batch_scheduler_policy!r}")
        self.engine = engine
        self.no_evict = batch_scheduler_policy == "guaranteed_no_evict"
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit() against the thread's exit
        self._stopped = False
        self._ids = itertools.count()
        # Touched only by the loop's thread:
        self._live: list[_Submission] = []
        self._pending: deque[tuple[_Submission, int]] = deque()  # (submission, row), in arrival order
        self._owner: dict[str, _Submission] = {}  # engine request id -> its submission
        self._reserved = 0  # KV blocks reserved by the rows in the engine
        self._thread = threading.Thread(target=self._run, name="kiln-triton-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompts: Sequence[Prompt], params: Sequence[SamplingParams], sink: Sink) -> None:
        """Queues one submission (one Triton request: a row per prompt); returns at once. Raises
        RuntimeError once the loop has stopped."""
        if len(prompts) != len(params) or not prompts:
            raise ValueError(f"need one SamplingParams per prompt, got {len(params)} for {len(prompts)} prompts")
        with self._lock:
            if self._stopped:
                raise RuntimeError("the kiln engine has stopped")
            self._commands.put((list(prompts), list(params), sink))

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts every submission (`abort(UNLOADING)`) and ends the thread."""
        with self._lock:
            if not self._stopped:
                self._commands.put(_STOP)
        self._thread.join(timeout)

    # ---- the loop's thread ---------------------------------------------------------------------
    def _run(self) -> None:
        reason = UNLOADING
        try:
            while True:
                for command in self._take_commands(block=not self._live):
                    if command is _STOP:
                        for submission in list(self._live):
                            self._abort(submission, UNLOADING)
                        return
                    self._add(*command)
                for submission in list(self._live):
                    if self._guarded(submission, submission.sink.cancelled):
                        self._abort(submission, None)
                self._admit()
                if self.engine.has_unfinished():
                    for output in self.engine.step():
                        self._deliver(output)
        except BaseException as e:  # a crashed engine must not leave Triton's clients waiting
            logger.exception("the kiln engine thread failed")
            reason = f"the kiln engine failed: {e!r}"
            for submission in self._live:
                self._guarded(None, submission.sink.abort, reason)
            self._live.clear()
        finally:
            with self._lock:
                self._stopped = True
            for command in self._take_commands(block=False):  # submitted while the loop was ending
                if command is not _STOP:
                    self._guarded(None, command[2].abort, reason)

    def _take_commands(self, block: bool) -> list:
        """What has arrived; when `block`, waits for at least one command."""
        commands: list = []
        while True:
            try:
                commands.append(self._commands.get(block=block and not commands))
            except queue.Empty:
                return commands

    def _add(self, prompts: list[Prompt], params: list[SamplingParams], sink: Sink) -> None:
        token_ids = []
        for row, (prompt, p) in enumerate(zip(prompts, params)):
            try:  # checked here, before anything is admitted: one bad row rejects the whole submission
                ids = self.engine.tokenize(prompt)
                self.engine.check_fits(len(ids), p)
            except ValueError as e:
                message = str(e) if len(prompts) == 1 else f"batch row {row}: {e}"
                self._guarded(None, sink.reject, message)
                return
            token_ids.append(ids)
        blocks = [self.engine.block_manager.blocks_needed(len(ids) + p.max_tokens)
                  for ids, p in zip(token_ids, params)]
        submission = _Submission(sink, token_ids, params, blocks, num_pending=len(prompts))
        self._live.append(submission)
        self._pending.extend((submission, row) for row in range(len(prompts)))

    def _admit(self) -> None:
        total = self.engine.block_manager.num_blocks
        while self._pending:
            submission, row = self._pending[0]
            if self.no_evict and self._reserved + submission.blocks[row] > total:
                break  # first come, first served: nobody overtakes the head of the queue
            self._pending.popleft()
            try:
                request_id = self.engine.add_request(submission.token_ids[row], submission.params[row],
                                                     f"triton-{next(self._ids)}")
            except ValueError as e:  # e.g. a guide xgrammar cannot compile: the whole submission is refused
                self._reject(submission, row, e)
                continue
            except Exception as e:  # a failure of this request alone: the loop and the other requests go on
                logger.exception("adding a request failed")
                self._drop(submission)
                self._guarded(None, submission.sink.fail, f"internal error: {e!r}", False)
                continue
            submission.num_pending -= 1
            submission.running[request_id] = row
            self._owner[request_id] = submission
            self._reserved += submission.blocks[row]

    def _deliver(self, output: RequestOutput) -> None:
        submission = self._owner.get(output.request_id)
        if submission is None:
            return
        row = submission.running[output.request_id]
        if output.error is not None:  # this row failed alone: the submission ends with its error
            self._release(output.request_id)
            self._drop(submission)
            prefix = "" if len(submission.params) == 1 else f"batch row {row}: "
            message = prefix + (f"{TRITON_GUIDE_LABEL}: " if output.error.client_error else "") + output.error.message
            self._guarded(None, submission.sink.fail, message, output.error.client_error)
            return
        if output.finished:
            self._release(output.request_id)
            if submission.done:
                self._live.remove(submission)
        self._guarded(submission, submission.sink.update, row, output)

    def _reject(self, submission: _Submission, row: int, error: ValueError) -> None:
        """The engine refused a row when it was added: the submission's other rows stop too (freeing their KV
        blocks) and it gets one error naming the row and, for a guide, the input."""
        message = refusal_message(error, TRITON_GUIDE_LABEL)
        self._drop(submission)
        self._guarded(None, submission.sink.reject,
                      message if len(submission.params) == 1 else f"batch row {row}: {message}")

    def _release(self, request_id: str) -> None:
        submission = self._owner.pop(request_id)
        self._reserved -= submission.blocks[submission.running.pop(request_id)]

    def _abort(self, submission: _Submission, message: str | None) -> None:
        self._drop(submission)
        self._guarded(None, submission.sink.abort, message)

    def _drop(self, submission: _Submission) -> None:
        """Takes the submission out of the engine (freeing its KV blocks) and out of the queue."""
        for request_id in list(submission.running):
            self.engine.abort(request_id)
            self._release(request_id)
        if submission.num_pending:
            self._pending = deque(item for item in self._pending if item[0] is not submission)
            submission.num_pending = 0
        if submission in self._live:
            self._live.remove(submission)

    def _guarded(self, submission: _Submission | None, call: Callable, *args):
        """Calls into a sink; a sink that raises loses its submission but does not stop the loop."""
        try:
            return call(*args)
        except Exception:
            logger.exception("a Triton response could not be sent; dropping its request")
            if submission is not None:
                self._drop(submission)
            return None
