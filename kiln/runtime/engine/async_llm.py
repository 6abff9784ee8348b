"""An asyncio front for the engine: many coroutines generate at once from one event loop.

The engine runs in one background thread (model steps release the GIL, so the event loop stays
responsive); coroutines talk to it through a command queue and receive their outputs through
per-request asyncio queues. Leaving a `generate` iteration early (a client that went away) aborts the
request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from kiln.runtime.core.guided_decoding import GuidedDecoding
from kiln.runtime.core.lora_request import LoRARequest
from kiln.runtime.core.outputs import RequestOutput
from kiln.runtime.core.request_checks import Prompt
from kiln.runtime.core.request_failure import EngineDeadError, RequestFailed
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.engine.factory import create_engine
from kiln.runtime.options import RuntimeOptions, runtime_options

logger = logging.getLogger("kiln.runtime")


class AsyncLLM:
    """`AsyncLLM(engine_dir, options=RuntimeOptions(...))`, or the options' field names as keywords, as `LLM`."""

    def __init__(self, engine_dir: str | Path, *, options: RuntimeOptions | None = None, **keywords: Any) -> None:
        self.engine = create_engine(engine_dir, runtime_options(options, keywords, "AsyncLLM"))
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> (its event loop, its output queue); touched only by the engine thread
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        # Orders _send against the engine thread's exit: a command is either taken by the thread or failed
        # by it on the way out, never left in the queue with its caller waiting.
        self._send_lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- what a front end needs to know of the engine (plain values, safe from any thread) ----------------
    @property
    def max_seq_len(self) -> int:
        return self.engine.runtime.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self.engine.runtime.max_batch_size

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    @property
    def architecture(self) -> str:
        """The Hugging Face architecture the engine was built from (e.g. "LlamaForCausalLM")."""
        return self.engine.info.spec.architecture

    def tokenize(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids, checked (a ValueError names the problem). Thread-safe: front ends call it on
        their own threads so the engine thread never tokenizes."""
        return self.engine.tokenize(prompt)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raises ValueError naming the limit (max_seq_len, the KV cache) when such a request could never run."""
        self.engine.check_fits(num_prompt_tokens, params)

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yields outputs for one request as it advances (cumulative, or what is new with
        SamplingParams.output_kind "delta"); the last one has `finished` set.
        Invalid input raises ValueError (naming the field) before anything is queued. A request that fails
        alone (runtime/core/request_failure.py: its constraint leads nowhere, ...) raises RequestFailed, its
        `failure.client_error` saying whose fault it was; an engine that has stopped raises EngineDeadError."""
        loop = asyncio.get_running_loop()
        if isinstance(prompt, str):
            # Tokenized here, in the loop's default executor: a long text takes seconds, which on the engine
            # thread would stall every running request (the tokenizer releases the GIL, so the loop runs on).
            prompt = await loop.run_in_executor(None, self.engine.tokenize, prompt)
        guided = sampling_params.guided_decoding if isinstance(sampling_params, SamplingParams) else None
        if guided is not None:
            await self.compile_guide(guided)
        adapter = None
        if lora_request is not None and not self.engine.lora.holds(lora_request):
            # Read from disk here, in the loop's default executor: on the engine thread a slow disk would stall
            # every running request. A bad adapter raises its ValueError naming it.
            adapter = await loop.run_in_executor(None, self.engine.lora.read, lora_request)
        sink: asyncio.Queue = asyncio.Queue()
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("add", prompt, sampling_params, request_id, lora_request, adapter, loop, sink, added))
        try:
            request_id = await asyncio.wrap_future(added)
        except asyncio.CancelledError:  # cancelled while the engine adds it: abort it once added
            added.add_done_callback(self._abort_if_added)
            raise
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine has stopped: nothing left to abort
                    raise item
                finished = item.finished
                if item.error is not None:  # ended alone by a failure of its own; the engine goes on
                    raise RequestFailed(item.request_id, item.error)
                yield item
                if finished:
                    return
        finally:
            if not finished:
                with contextlib.suppress(EngineDeadError):  # stopped meanwhile: nothing left to abort
                    self._send(("abort", request_id, None))

    async def compile_guide(self, guided: GuidedDecoding) -> None:
        """Compiles a constraint (cached: `generate` then finds it), off the engine thread so a slow one does not
        stall every running request. A bad one raises its ValueError naming the problem (the refusal is cached
        too). `generate` calls it; a front end may call it first to refuse a batch row by row, in order."""
        await asyncio.get_running_loop().run_in_executor(None, self._compile, guided)

    def _compile(self, guided: GuidedDecoding) -> None:
        self.engine.guided_masker().compiler.compile(guided)

    def _abort_if_added(self, added: concurrent.futures.Future) -> None:
        if not added.cancelled() and added.exception() is None:
            self._send(("abort", added.result(), None))

    async def abort(self, request_id: str) -> RequestOutput | None:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("abort", request_id, done))
        return await asyncio.wrap_future(done)

    async def call(self, fn, *args):
        """Runs fn(engine, *args) on the engine thread (e.g. to read stats consistently)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, args, done))
        return await asyncio.wrap_future(done)

    @property
    def is_running(self) -> bool:
        """False once the engine thread has stopped (shutdown, or a crash) or the executor has failed (a
        tensor-parallel rank died: noticed even while idle)."""
        return not self._stopped.is_set() and self.engine.fault is None

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine thread, if it crashed."""
        return self._error

    @property
    def stop_reason(self) -> str:
        """Why the engine has stopped (a dead tensor-parallel rank, the thread's crash), for logs and errors."""
        return self._stop_reason()

    def kv_cache_stats(self) -> dict[str, int]:
        """A snapshot; reads plain counters, safe from any thread."""
        return self.engine.kv_cache_stats()

    def speculation_stats(self) -> dict | None:
        """Speculative decoding's counters (None without it); plain counters, safe from any thread."""
        return self.engine.speculation_stats()

    def lora_stats(self) -> dict[str, int] | None:
        """LoRA adapters' counters (`LLM.lora_stats`; None without enable_lora); plain counters, safe from any
        thread."""
        return self.engine.lora.stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts what is running and stops the engine thread."""
        if self._thread.is_alive():
            with contextlib.suppress(EngineDeadError):  # it is stopping by itself
                self._send(("stop",))
            self._thread.join(timeout)

    # ---- engine thread -------------------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        with self._send_lock:
            if self._stopped.is_set():
                raise EngineDeadError(self._stop_reason())
            self._commands.put(command)

    def _stop_reason(self) -> str:
        fault = self.engine.fault
        if fault is not None:
            return f"the engine has stopped: {fault}"
        return f"the engine has stopped{': ' + repr(self._error) if self._error else ''}"

    def _run(self) -> None:
        try:
            while True:
                # Block for work when idle; otherwise take what has arrived and step.
                block = not self.engine.has_unfinished()
                while True:
                    try:
                        command = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    if command[0] == "stop":
                        self._abort_all()
                        return
                    self._handle(command)
                for out in self.engine.step():
                    self._deliver(out)
        except BaseException as e:  # a crashed engine must not leave coroutines waiting forever
            logger.exception("engine thread failed")
            self._error = e
        finally:
            with self._send_lock:
                self._stopped.set()
            self._fail_everyone()
            self.engine.shutdown()

    def _fail_everyone(self) -> None:
        """The engine thread is ending: every request still running, and every command still queued, is told
        at once (EngineDeadError), so no caller waits for an engine that will never answer."""
        reason = self._stop_reason()
        for loop, sink in self._sinks.values():
            with contextlib.suppress(RuntimeError):  # that caller's loop is closed
                loop.call_soon_threadsafe(sink.put_nowait, EngineDeadError(reason))
        self._sinks.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            done = command[-1] if command[0] in ("add", "abort", "call") else None
            if isinstance(done, concurrent.futures.Future) and done.set_running_or_notify_cancel():
                done.set_exception(EngineDeadError(reason))

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, prompt, params, request_id, lora_request, adapter, loop, sink, added = command
            if not added.set_running_or_notify_cancel():  # its caller was cancelled before it got here
                return
            try:
                if adapter is not None:  # read by generate: only kept here
                    self.engine.lora.admit(lora_request, adapter)
                request_id = self.engine.add_request(prompt, params, request_id, lora_request)
            except Exception as e:  # invalid input (ValueError, TypeError) or a failure of this request alone
                added.set_exception(e)
                return
            self._sinks[request_id] = (loop, sink)
            added.set_result(request_id)
        elif kind == "abort":
            _, request_id, done = command
            out = self.engine.abort(request_id)
            if out is not None:
                self._deliver(out)
            if done is not None and done.set_running_or_notify_cancel():
                done.set_result(out)
        elif kind == "call":
            _, fn, args, done = command
            if not done.set_running_or_notify_cancel():
                return
            try:
                done.set_result(fn(self.engine, *args))
            except Exception as e:
                done.set_exception(e)

    def _deliver(self, out: RequestOutput) -> None:
        target = self._sinks.get(out.request_id)
        if target is None:
            return
        if out.finished:
            del self._sinks[out.request_id]
        loop, sink = target
        try:
            loop.call_soon_threadsafe(sink.put_nowait, out)
        except RuntimeError:  # the caller's loop is closed; nobody is listening any more
            if not out.finished:
                self.engine.abort(out.request_id)
                self._sinks.pop(out.request_id, None)

    def _abort_all(self) -> None:
        for request_id in list(self._sinks):
            out = self.engine.abort(request_id)
            if out is not None:
                self._deliver(out)
