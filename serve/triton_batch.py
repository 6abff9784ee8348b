"""Running Triton requests on the engine, shared by the HTTP and gRPC front ends: one request to the end, or
all rows of a batch at once, all or none."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection

from .engine_service import EngineService
from .errors import RequestError
from .triton_request import TritonRequest


async def complete(service: EngineService, request: TritonRequest) -> tuple[str, list[float]]:
    """Runs one request to the end -> (text_output: the prompt and the generated text unless exclude_input,
    per-token logprobs)."""
    async with contextlib.aclosing(service.generate(request.prompt, request.params)) as stream:
        async for delta in stream:
            output = delta.output
    text = output.text if request.exclude_input else request.prompt + output.text
    return text, list(output.logprobs or [])


async def cancel_and_wait(tasks: Collection[asyncio.Task]) -> None:
    """Cancels each task once and waits for it to end. Not with gather: a second cancellation of the caller
    would reach the tasks again and cut short their cleanup (aborting their engine requests)."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)


async def complete_all(service: EngineService, requests: list[TritonRequest]) -> list[tuple[str, list[float]]]:
    """Runs all rows at once -> `complete`'s result per row. The first failure (or the caller's cancellation)
    cancels the others, aborting their engine requests; in a batch of several, a RequestError's message
    names its row."""
    async def row(i: int, request: TritonRequest) -> tuple[str, list[float]]:
        try:
            return await complete(service, request)
        except RequestError as e:
            if len(requests) > 1:
                e.message = f"batch row {i}: {e.message}"
            raise

    tasks = [asyncio.ensure_future(row(i, r)) for i, r in enumerate(requests)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        await cancel_and_wait(tasks)
    errors = [task.exception() for task in tasks if not task.cancelled() and task.exception() is not None]
    if errors:
        raise errors[0]
    return [task.result() for task in tasks]
