"""The engine as every front end sees it: admission (and refusal while shutting down), per-request
deltas for streaming, metrics, and draining at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kiln.runtime import LoRARequest, Prompt
from kiln.runtime.core.outputs import CompletionOutput, RequestOutput
from kiln.runtime.core.request_failure import EngineDeadError, RequestFailed
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.engine.async_llm import AsyncLLM
from kiln.serve.errors import InternalError, InvalidRequest, Overloaded, RequestError, Unavailable
from kiln.serve.guided_request import engine_refusal
from kiln.serve.lora_modules import LoRAModules
from kiln.serve.metrics import ServeMetrics
from kiln.serve.prompt_work import PromptWorker
from kiln.serve.request_progress import CumulativeOutput, RequestProgress


@dataclass(frozen=True)
class Delta:
    """What one engine update added to a request; `output` is the cumulative state as of it (its token list,
    text and logprobs copied out when read: request_progress.py)."""

    output: RequestOutput | CumulativeOutput
    text: str  # new text since the previous delta
    token_ids: list[int]  # new tokens
    logprobs: list[float] = field(default_factory=list)  # new, when asked
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # new, when asked

    @property
    def finished(self) -> bool:
        return self.output.finished

    @property
    def beams(self) -> list[CompletionOutput] | None:
        """Beam search: the current beams whole, best first (each update holds them all; `text`, `token_ids` and
        `logprobs` are then empty); None for a plain request."""
        return getattr(self.output, "beam_outputs", None)

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason


class EngineService:
    """Wraps an AsyncLLM for the servers. Use `generate` inside `contextlib.aclosing(...)` so that a
    client that goes away aborts its request at once."""

    def __init__(self, llm: AsyncLLM, model_name: str, max_queued_requests: int | None = None,
                 loras: LoRAModules | None = None) -> None:
        self.llm = llm
        self.model_name = model_name
        # the LoRA adapters served by name (none unless the server has --enable-lora)
        self.loras = loras if loras is not None else LoRAModules(model_name, enabled=False)
        # Requests admitted but not yet running in the engine, at most (None: no limit).
        self.max_queued_requests = max_queued_requests
        self.metrics = ServeMetrics(llm.kv_cache_stats, llm.speculation_stats, lambda: len(self.loras),
                                    getattr(llm, "lora_stats", lambda: None))
        # Tokenizing, chat templating and decoding large texts: never on the event loop or the engine thread.
        self.prompt_work = PromptWorker()
        self.accepting = True
        self._ids = itertools.count()
        self._inflight: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_seq_len(self) -> int:
        return self.llm.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self.llm.max_batch_size

    @property
    def ready(self) -> bool:
        return self.accepting and self.llm.is_running

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def num_queued(self) -> int:
        """Admitted requests the engine is not running yet (waiting for a batch slot or KV blocks)."""
        return max(0, len(self._inflight) - self.llm.kv_cache_stats()["num_running"])

    def check_admission(self) -> None:
        """Raises Unavailable while shutting down and Overloaded when the queue is full; requests already
        admitted are never dropped to make room."""
        if not self.accepting:
            raise Unavailable("the server is shutting down and takes no new requests")
        if not self.llm.is_running:
            raise Unavailable("the engine has stopped and takes no new requests; the server is exiting")
        limit = self.max_queued_requests
        if limit is not None and self.num_queued >= limit:
            self.metrics.requests.labels("overloaded").inc()
            raise Overloaded(f"the server is overloaded: {limit} requests are already waiting for the engine "
                             f"(--max-queued-requests {limit}); retry later")

    def new_request_id(self, prefix: str = "kiln") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def run_prompt_work(self, fn, *args, size: int = 0):
        """`fn(*args)` on the prompt worker's threads (prompt_work.py); `size`: the characters of text it works
        on (after a large one, freed memory goes back to the operating system)."""
        return await self.prompt_work.run(fn, *args, size=size)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The engine's `tokenize` (a ValueError names what is wrong), for the prompt worker; a text's ids are
        not checked at all when there are more than max_seq_len of them: that prompt is refused for its length
        before it reaches the engine."""
        tokenizer = self.llm.tokenizer
        if isinstance(prompt, str) and prompt and tokenizer is not None:
            ids = tokenizer.encode(prompt)
            if len(ids) > self.max_seq_len:
                return list(ids)
            prompt = ids
        return self.llm.tokenize(prompt)

    async def prompt_ids(self, prompt: Prompt, params: SamplingParams) -> Prompt:
        """A text prompt's token ids, tokenized on the prompt worker; a prompt of token ids is checked to fit
        (max_seq_len, the KV cache) here too, so the engine thread never tokenizes a request nor walks a prompt
        it would refuse. Raises ValueError naming the problem, as the engine would."""
        if isinstance(prompt, str):
            prompt = await self.run_prompt_work(self.tokenize, prompt, size=len(prompt))
        if isinstance(prompt, list):
            self.llm.check_fits(len(prompt), params)
        return prompt

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, *,
                       cut_off_is_error: bool = False, guided_field: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[Delta]:
        """Yields a Delta per engine update; the last has `finished`. Invalid input raises InvalidRequest
        (before anything is yielded); a server that is shutting down raises Unavailable, and a full queue
        Overloaded. With `cut_off_is_error` (Triton's protocols, which have no finish reason), a request
        that shutdown aborted raises Unavailable instead of ending as a success with partial text. A request
        that fails alone raises InvalidRequest (its constraint led nowhere) or InternalError, at any point; an
        engine that has stopped raises Unavailable for every request at once.
        `guided_field`: the request field that `params.guided_decoding` came from, which the error names when
        the engine cannot compile the constraint. `lora_request`: the LoRA adapter it runs with (None: the base
        model); the adapter counts as in use (it cannot be unloaded) until the request is over."""
        self.check_admission()
        request_id = request_id or self.new_request_id()
        metrics = self.metrics
        start = last = time.perf_counter()
        # The engine hands over what each step added; the progress adds it up for whoever reads `output`.
        params = params if params.output_kind == "delta" else dataclasses.replace(params, output_kind="delta")
        try:
            prompt = await self.prompt_ids(prompt, params)
        except ValueError as e:
            metrics.requests.labels("rejected").inc()
            raise engine_refusal(e, guided_field) from None
        stream = _engine_errors(self.llm.generate(prompt, params, request_id=request_id,
                                                  lora_request=lora_request), guided_field)
        if lora_request is not None:
            metrics.lora_requests.labels(lora_request.lora_name).inc()
        self.loras.acquire(lora_request)
        self._inflight.add(request_id)
        self._idle.clear()
        outcome = "error"
        progress = RequestProgress()
        try:
            try:
                out = await anext(stream)
            except RequestError:
                raise
            except ValueError as e:
                outcome = "rejected"
                raise engine_refusal(e, guided_field) from None
            metrics.prompt_tokens.inc(len(out.prompt_token_ids))
            generated = 0  # tokens so far (beam search: of the best beam)
            while True:
                now = time.perf_counter()
                # a beam search's update holds its beams whole: what it added is how far the best one grew
                new = len(out.token_ids) if out.beam_outputs is None else max(0, len(out.token_ids) - generated)
                if new > 0:
                    if not generated:
                        metrics.time_to_first_token.observe(now - start)
                        new_gaps = new - 1
                    else:
                        new_gaps = new
                    for _ in range(new_gaps):
                        metrics.inter_token_latency.observe((now - last) / new)
                    metrics.generation_tokens.inc(new)
                    last = now
                    generated += new
                if out.beam_outputs is not None:  # nothing to add up: the update is the beams as they stand
                    delta = Delta(out, "", [])
                else:
                    delta = Delta(progress.add(out), out.text, out.token_ids, out.logprobs or [],
                                  out.top_logprobs or [])
                if out.finished:
                    outcome = out.finish_reason
                    if cut_off_is_error and outcome == "abort":
                        raise Unavailable(f"the request was cut off by server shutdown after "
                                          f"{generated} generated token(s); send it again to a "
                                          f"running server")
                    metrics.e2e_latency.observe(now - start)
                    yield delta
                    return
                yield delta
                out = await anext(stream)
        except (asyncio.CancelledError, GeneratorExit):
            if outcome == "error":  # not finished yet: the consumer left (a consumer closing after the
                outcome = "abort"   # final delta changes nothing)
            raise
        finally:
            metrics.requests.labels(outcome).inc()
            # Shielded: a second cancellation of the consumer must not cut the cleanup short.
            await asyncio.shield(asyncio.ensure_future(self._release(request_id, stream,
                                                                     abort=outcome in ("abort", "error"),
                                                                     lora_request=lora_request)))

    async def _release(self, request_id: str, stream: AsyncIterator, abort: bool,
                       lora_request: LoRARequest | None = None) -> None:
        try:
            if abort:
                # Wait for the engine to drop it, so its KV blocks are free once the consumer moves on.
                with contextlib.suppress(RuntimeError):  # the engine has stopped: nothing left to free
                    await self.llm.abort(request_id)
            await stream.aclose()
        finally:
            self.loras.release(lora_request)
            self._inflight.discard(request_id)
            if not self._inflight:
                self._idle.set()

    async def drain(self, timeout: float) -> int:
        """Stops admitting; waits up to `timeout` s for running requests, then aborts the rest.
        Returns how many were aborted."""
        self.accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return 0
        except asyncio.TimeoutError:
            left = list(self._inflight)
            # All at once: the engine thread takes every queued command before its next step, so a thousand
            # aborts cost one step, not a thousand.
            with contextlib.suppress(RuntimeError):  # the engine has stopped: nothing left to abort
                await asyncio.gather(*(self.llm.abort(request_id) for request_id in left))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 5.0)
            return len(left)


async def _engine_errors(stream: AsyncIterator[RequestOutput],
                         guided_field: str | None) -> AsyncIterator[RequestOutput]:
    """The engine's updates, its failures turned into what the front ends answer: a request that failed alone
    is a 400 (its own input: the constraint from `guided_field`) or a 500 for it only, and a stopped engine a
    503 for everyone."""
    try:
        async for out in stream:
            yield out
    except RequestFailed as e:
        failure = e.failure
        if failure.client_error:
            where = f"{guided_field}: " if guided_field else ""
            raise InvalidRequest(where + failure.message, guided_field) from None
        raise InternalError(failure.message) from None
    except EngineDeadError as e:
        raise Unavailable(f"the engine has stopped and can finish no request ({e}); the server is exiting") \
            from None
    finally:
        await stream.aclose()
