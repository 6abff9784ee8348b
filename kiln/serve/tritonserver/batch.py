"""Running Triton requests on the engine, shared by the HTTP and gRPC front ends: each row's LoRA adapter
resolved, one request to the end, or all rows of a batch at once, all or none."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import weakref
from collections.abc import AsyncIterator, Collection, Sequence

from kiln.runtime import Prompt
from kiln.serve.engine_service import EngineService
from kiln.serve.errors import InvalidRequest, RequestError
from kiln.serve.guided_request import TRITON_GUIDE_LABEL
from kiln.serve.limits import RequestLimits
from kiln.serve.tritonserver.beam_rows import beams_of, check_beam_widths
from kiln.serve.tritonserver.lora_tasks import LoRATasks
from kiln.serve.tritonserver.request import Beam, TritonRequest

# kiln serve's LoRA tasks, one per EngineService (shared by its HTTP and gRPC front ends).
_SERVICE_TASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
SERVE_OFF_HINT = "start kiln serve with --enable-lora"
SERVE_UNLOAD_HINT = (" (or unload it first: POST /v1/unload_lora_adapter {{\"lora_name\": \"{name}\"}}, once no "
                     "request uses it)")


def service_tasks(service: EngineService) -> LoRATasks:
    tasks = _SERVICE_TASKS.get(service)
    if tasks is None:
        tasks = _SERVICE_TASKS[service] = LoRATasks(service.llm, service.loras, SERVE_OFF_HINT, SERVE_UNLOAD_HINT)
    return tasks


@contextlib.asynccontextmanager
async def with_loras(service: EngineService, rows: Sequence[TritonRequest]) -> AsyncIterator[list[TritonRequest]]:
    """Each row with the LoRA adapter its inputs select (`lora_request`, lora_tasks.py), counted in use (so not
    unloadable) from when it is resolved until the block ends; a new adapter is converted and read on a worker
    thread. In a batch of several, an error names its row."""
    tasks = service_tasks(service)
    with contextlib.ExitStack() as in_use:
        out = []
        for i, row in enumerate(rows):
            if row.lora is None:
                out.append(row)
                continue
            try:
                if tasks.needs_loading(row.lora):
                    lora = await asyncio.to_thread(tasks.resolve, row.lora)
                else:
                    lora = tasks.resolve(row.lora)
            except InvalidRequest as e:
                if len(rows) > 1:
                    e.message = f"batch row {i}: {e.message}"
                raise
            in_use.enter_context(service.loras.using(lora))
            out.append(dataclasses.replace(row, lora_request=lora))
        yield out


async def complete(service: EngineService, request: TritonRequest, prompt: Prompt | None = None) -> list[Beam]:
    """Runs one request to the end -> its beams (one without beam search): text_output is the prompt and the
    generated text unless exclude_input. `prompt`: the request's prompt as token ids, when already tokenized."""
    prompt = request.prompt if prompt is None else prompt
    # Triton has no finish reason: a request cut off by shutdown must fail, not succeed with partial text.
    stream = service.generate(prompt, request.params, cut_off_is_error=True, guided_field=TRITON_GUIDE_LABEL,
                              lora_request=request.lora_request)
    async with contextlib.aclosing(stream) as stream:
        async for delta in stream:
            output = delta.output
    return beams_of(request, output)


async def cancel_and_wait(tasks: Collection[asyncio.Task]) -> None:
    """Cancels each task once and waits for it to end. Not with gather: a second cancellation of the caller
    would reach the tasks again and cut short their cleanup (aborting their engine requests)."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)


async def complete_all(service: EngineService, requests: list[TritonRequest],
                       limits: RequestLimits | None = None) -> list[list[Beam]]:
    """Runs all rows at once -> `complete`'s result per row. With `limits`, every row is tokenized first, and
    a batch whose prompts hold more tokens than the server takes is refused before any row starts. The first
    failure (or the caller's cancellation) cancels the others, aborting their engine requests; in a batch of
    several, a RequestError's message names its row."""
    def in_row(i: int, error: RequestError) -> RequestError:
        if len(requests) > 1:
            error.message = f"batch row {i}: {error.message}"
        return error

    check_beam_widths(service.llm, requests)
    prompts: list[Prompt] = [r.prompt for r in requests]
    if limits is not None:
        tokenize = limits.prompt_tokens(service.tokenize, "text_input")

        def tokenize_rows() -> None:  # on the prompt worker, never on the event loop
            for i, request in enumerate(requests):
                try:
                    prompts[i] = tokenize(request.prompt)
                except RequestError as e:
                    raise in_row(i, e) from None

        await service.run_prompt_work(tokenize_rows, size=sum(len(r.prompt) for r in requests))

    async def row(i: int, request: TritonRequest) -> list[Beam]:
        try:
            return await complete(service, request, prompts[i])
        except RequestError as e:
            raise in_row(i, e) from None

    tasks = [asyncio.ensure_future(row(i, r)) for i, r in enumerate(requests)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        await cancel_and_wait(tasks)
    errors = [task.exception() for task in tasks if not task.cancelled() and task.exception() is not None]
    if errors:
        raise errors[0]
    return [task.result() for task in tasks]
