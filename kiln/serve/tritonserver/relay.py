"""Relays the Triton model's submissions to `AsyncLLM` and each row's outputs back to its submission's sink.

Triton's Python backend is not asyncio: `execute` runs on Triton's thread and, in decoupled mode, returns at
once while the responses follow later. The relay runs one asyncio event loop in its own thread; a submission
(one Triton request: a row per prompt) becomes one task there that generates every row through `AsyncLLM`
(whose engine thread does the in-flight batching, as for `kiln serve`) and calls the sink as outputs arrive.
When a request may enter the running batch (TensorRT-LLM's batch_scheduler_policy) is the scheduler's
capacity policy (runtime/core/capacity.py), set through RuntimeOptions; the relay holds no policy of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from kiln.runtime import AsyncLLM, LoRARequest, RequestOutput, SamplingParams
from kiln.runtime.core.request_failure import EngineDeadError, RequestFailed
from kiln.serve.guided_request import TRITON_GUIDE_LABEL, refusal_message

logger = logging.getLogger("kiln.serve")

UNLOADING = "the model is being unloaded"
CANCEL_POLL_S = 0.05  # how often a client's cancellation is looked for (Triton only answers when asked)


class Sink(Protocol):
    """Where one submission's results go. Called on the relay's thread only. A submission ends with exactly
    one of: `update` of its last unfinished row with a finished output, `reject`, `abort` or `fail`."""

    def cancelled(self) -> bool:
        """The client went away: the submission is aborted (and `abort(None)` called)."""

    def update(self, row: int, output: RequestOutput) -> None:
        """Row `row` advanced; `output` is cumulative (the runtime's RequestOutput)."""

    def reject(self, message: str) -> None:
        """The submission is invalid (a guide that does not compile, ...); its rows were stopped."""

    def abort(self, message: str | None) -> None:
        """The submission was stopped: cancelled (message None), or the relay or engine is stopping (why)."""

    def fail(self, message: str, client_error: bool) -> None:
        """A row failed alone once running (runtime/core/request_failure.py): its constraint led nowhere
        (`client_error`) or kiln failed it; the submission's other rows were stopped."""


class _Ended(Exception):
    """A submission's end other than finishing: the sink call that tells its client."""

    def __init__(self, call: Callable, *args) -> None:
        super().__init__()
        self.call, self.args = call, args


class Relay:
    """Submissions in, sink calls out. `llm` is shared, not owned: the caller shuts it down after `stop`."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self._ids = itertools.count()
        self._lock = threading.Lock()  # orders submit() against stop()
        self._stopped = False
        self._tasks: set[asyncio.Task] = set()  # touched on the relay's thread only
        # Submissions' constraints compile one after another, in arrival order (as when the Triton model had its
        # own engine loop): a batch of guided requests then never waits past the compile limit for a slot.
        self._compiling = asyncio.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kiln-triton-relay", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped and self.llm.is_running

    def submit(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], sink: Sink,
               loras: Sequence[LoRARequest | None] | None = None) -> None:
        """Queues one submission (token ids per row, checked by the caller; `loras`: each row's LoRA adapter,
        None for the base model); returns at once. Raises RuntimeError once the relay or its engine has stopped."""
        if len(prompts) != len(params) or not prompts:
            raise ValueError(f"need one SamplingParams per prompt, got {len(params)} for {len(prompts)} prompts")
        loras = list(loras) if loras is not None else [None] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"need one LoRA adapter (or None) per prompt, got {len(loras)} for {len(prompts)}")
        with self._lock:
            if self._stopped or not self.llm.is_running:
                raise RuntimeError("the kiln engine has stopped" if self._stopped else self.llm.stop_reason)
            self._loop.call_soon_threadsafe(self._start, list(prompts), list(params), sink, loras)

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts every submission (`abort(UNLOADING)`) and ends the relay's thread."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop).result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    # ---- the relay's thread ----------------------------------------------------------------------
    def _start(self, prompts: list[list[int]], params: list[SamplingParams], sink: Sink,
               loras: list[LoRARequest | None]) -> None:
        task = self._loop.create_task(self._serve(prompts, params, sink, loras))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel(UNLOADING)
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, prompts: list[list[int]], params: list[SamplingParams], sink: Sink,
                     loras: list[LoRARequest | None]) -> None:
        sink = _Answered(sink, len(prompts))
        try:
            await self._compile_guides(params, sink)
        except _Ended as ended:
            _guarded(ended.call, *ended.args)
            return
        except asyncio.CancelledError:
            _guarded(sink.abort, UNLOADING)
            return
        rows = [asyncio.ensure_future(self._row(sink, row, ids, p, len(prompts), lora))
                for row, (ids, p, lora) in enumerate(zip(prompts, params, loras))]
        watch = asyncio.ensure_future(self._watch_cancel(sink))
        ended: _Ended | None = None
        try:
            pending = set(rows)
            while pending and ended is None:
                done, pending = await asyncio.wait(pending | {watch}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(watch)
                for task in done:
                    error = task.exception()
                    if error is not None:
                        ended = ended or (error if isinstance(error, _Ended) else _Ended(lambda: None))
        except asyncio.CancelledError:
            ended = _Ended(sink.abort, UNLOADING)
        finally:
            for task in [*rows, watch]:
                task.cancel()  # leaving generate early aborts the request and frees its KV blocks
            await asyncio.gather(*rows, watch, return_exceptions=True)
        if ended is not None:
            _guarded(ended.call, *ended.args)

    async def _compile_guides(self, params: list[SamplingParams], sink: Sink) -> None:
        """Each distinct constraint compiled once, in row order, so a bad one refuses the submission naming its
        first row (the rows' `generate` then find it compiled, or refused, in the compiler's cache)."""
        seen: list = []  # a guide may hold a dict (a JSON schema): compared, not hashed
        for row, p in enumerate(params):
            guided = p.guided_decoding
            if guided is None or guided in seen:
                continue
            seen.append(guided)
            try:
                async with self._compiling:
                    await self.llm.compile_guide(guided)
            except ValueError as e:
                prefix = "" if len(params) == 1 else f"batch row {row}: "
                raise _Ended(sink.reject, prefix + refusal_message(e, TRITON_GUIDE_LABEL)) from None

    async def _row(self, sink: Sink, row: int, ids: list[int], params: SamplingParams, num_rows: int,
                   lora: LoRARequest | None) -> None:
        prefix = "" if num_rows == 1 else f"batch row {row}: "
        try:
            async for output in self.llm.generate(ids, params, f"triton-{next(self._ids)}", lora_request=lora):
                try:
                    sink.update(row, output)
                except Exception:  # its client cannot be told any more: the submission just ends
                    logger.exception("a Triton response could not be sent; dropping its request")
                    raise _Ended(lambda: None) from None
        except RequestFailed as e:  # this row failed alone: the submission ends with its error
            label = f"{TRITON_GUIDE_LABEL}: " if e.failure.client_error else ""
            raise _Ended(sink.fail, prefix + label + e.failure.message, e.failure.client_error) from None
        except EngineDeadError as e:
            raise _Ended(sink.abort, f"the kiln engine failed: {e}") from None
        except ValueError as e:  # refused when added, e.g. a guide xgrammar cannot compile
            raise _Ended(sink.reject, prefix + refusal_message(e, TRITON_GUIDE_LABEL)) from None
        except (asyncio.CancelledError, _Ended):
            raise
        except Exception as e:  # a failure of this request alone: the relay and the other requests go on
            logger.exception("a Triton request failed")
            raise _Ended(sink.fail, f"{prefix}internal error: {e!r}", False) from None

    @staticmethod
    async def _watch_cancel(sink: Sink) -> None:
        while not _guarded(sink.cancelled):
            await asyncio.sleep(CANCEL_POLL_S)
        raise _Ended(sink.abort, None)


class _Answered:
    """A submission's sink that knows when the submission has had its last answer: Triton may free the response
    sender then, and asking it whether the client cancelled crashes the server (a segfault in
    TRITONBACKEND_ResponseFactoryIsCancelled), so the cancellation watch may poll once more but never asks."""

    def __init__(self, sink: Sink, num_rows: int) -> None:
        self.sink, self.unfinished, self.over = sink, set(range(num_rows)), False

    def cancelled(self) -> bool:
        return not self.over and self.sink.cancelled()

    def update(self, row: int, output: RequestOutput) -> None:
        if output.finished:
            self.unfinished.discard(row)
            self.over = not self.unfinished
        self.sink.update(row, output)

    def reject(self, message: str) -> None:
        self.over = True
        self.sink.reject(message)

    def abort(self, message: str | None) -> None:
        self.over = True
        self.sink.abort(message)

    def fail(self, message: str, client_error: bool) -> None:
        self.over = True
        self.sink.fail(message, client_error)


def _guarded(call: Callable, *args):
    """Calls into a sink; one that raises loses its submission, never the relay."""
    try:
        return call(*args)
    except Exception:
        logger.exception("a Triton response could not be sent; dropping its request")
        return True  # for `cancelled`: treat a broken sink as gone
