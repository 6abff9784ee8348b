"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

A request becomes one engine request per choice (prompt i, choice j -> choice index i*n+j), all run at once;
the answer is one JSON object or, with `stream`, Server-Sent Events ending in `data: [DONE]`. A client that
goes away aborts its engine requests, which frees their KV blocks. Every invalid field is a 400 naming it.
Checking a request body and formatting the results live in openai_completions.py and openai_chat.py (with
openai_request.py and openai_format.py); this file is the aiohttp side.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import web

from kiln.runtime import LoRARequest
from kiln.runtime.core.outputs import RequestOutput
from kiln.serve.engine_service import Delta, EngineService
from kiln.serve.errors import InvalidRequest, RequestError, Unavailable
from kiln.serve.http.common import CONFIG, SERVICE, read_json
from kiln.serve.limits import RequestLimits
from kiln.serve.openai import lora_routes
from kiln.serve.openai.chat import chat_job, tool_call_parser
from kiln.serve.openai.completions import completion_job
from kiln.serve.openai.request import Choice, Job, check_model, expand_beams, model_in_use, usage

logger = logging.getLogger("kiln.serve")


# ---- running ----------------------------------------------------------------------------------------------
def _client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def _generate_all(request: web.Request, job: Job) -> AsyncIterator[tuple[Choice, Delta]]:
    """Runs every choice at once and yields their deltas as they come. Stops (aborting what still runs) when
    the client has gone; consume it inside `contextlib.aclosing` so that leaving early aborts the rest."""
    service = request.app[SERVICE]
    queue: asyncio.Queue[tuple[Choice, Delta | Exception | None]] = asyncio.Queue()  # None: a choice is done

    async def run(choice: Choice) -> None:
        try:
            stream = service.generate(choice.prompt, choice.params, f"{job.id}-{choice.index}",
                                      guided_field=job.guided_field, lora_request=job.lora_request)
            async with contextlib.aclosing(stream) as deltas:
                async for delta in deltas:
                    queue.put_nowait((choice, delta))
            queue.put_nowait((choice, None))
        except Exception as e:  # handed to the handler, which raises it
            queue.put_nowait((choice, e))

    tasks = [asyncio.create_task(run(choice)) for choice in job.choices]
    try:
        running = len(tasks)
        while running:
            choice, item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, InvalidRequest) and item.param is None:
                item.param = job.prompt_field
            if isinstance(item, Exception):
                raise item
            if _client_gone(request):
                return
            yield choice, item
    finally:
        for task in tasks:
            task.cancel()  # a finished one ignores it; a running one aborts its engine request
        await asyncio.gather(*tasks, return_exceptions=True)


async def _answer(request: web.Request, job: Job) -> web.Response:
    finals: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(_generate_all(request, job)) as events:
        async for choice, delta in events:
            if delta.finished:
                finals[choice.index] = delta.output
    if len(finals) < len(job.choices):  # the client went away
        return web.Response(status=499)
    if any(out.finish_reason == "abort" for out in finals.values()):
        raise Unavailable("the request was aborted: the server is shutting down")
    # a beam search's engine request is several choices, one per beam
    shown = [pair for c in job.choices for pair in expand_beams(c, finals[c.index])]
    body = _envelope(job, job.object, [job.format_choice(c, out) for c, out in shown])
    body["usage"] = usage([c for c, _ in shown], {c.index: out for c, out in shown})
    return web.json_response(body)


async def _answer_stream(request: web.Request, job: Job) -> web.StreamResponse:
    """Server-Sent Events. Headers go out once every choice has its first token, so that an invalid prompt
    still gets a 400; a write to a client that went away ends the stream (and aborts the rest)."""
    response: web.StreamResponse | None = None
    held: list[tuple[Choice, Delta]] = []
    begun: set[int] = set()
    finals: dict[int, RequestOutput] = {}

    async def send(payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await response.write(f"data: {data}\n\n".encode())

    try:
        async with contextlib.aclosing(_generate_all(request, job)) as events:
            async for choice, delta in events:
                held.append((choice, delta))
                if delta.finished:
                    finals[choice.index] = delta.output
                if response is None:
                    begun.add(choice.index)
                    if len(begun) < len(job.choices):
                        continue
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
                    await response.prepare(request)
                    begun.clear()
                for c, d in held:
                    pieces = job.format_delta(c, d, c.index not in begun)
                    begun.add(c.index)
                    for piece in pieces:
                        await send(_envelope(job, job.chunk_object, [piece]))
                held.clear()
        if response is None:  # the client went away before the first token
            return web.Response(status=499)
        if job.include_usage and len(finals) == len(job.choices):
            await send({**_envelope(job, job.chunk_object, []), "usage": usage(job.choices, finals)})
        await send("[DONE]")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client went away; leaving the loop aborted its requests
    except Exception as e:
        if response is None:
            raise  # nothing sent yet: the middleware answers with the error
        logger.exception("OpenAI stream %s failed", job.id)
        error = {"message": f"internal error: {e}", "type": "internal_error", "param": None, "code": 500}
        if isinstance(e, RequestError):
            error = {"message": e.message, "type": e.openai_type, "param": e.param, "code": e.status}
        with contextlib.suppress(ConnectionResetError):
            await send({"error": error})
            await send("[DONE]")  # as vLLM ends a failed stream: clients stop reading here
            await response.write_eof()
    return response


def _with_lora(job: Job, lora: LoRARequest | None) -> Job:
    """The job run with the adapter its `model` selected, answering under that model's name."""
    return job if lora is None else dataclasses.replace(job, lora_request=lora, model=lora.lora_name)


def _envelope(job: Job, obj: str, choices: list[dict]) -> dict:
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model, "choices": choices}


# ---- the endpoints -------------------------------------------------------------------------------------------
def add_routes(app: web.Application) -> None:
    created = int(time.time())

    def model_card(service: EngineService, name: str) -> dict:
        """vLLM's card: an adapter's `parent` is the base model, the base model's is null."""
        lora = service.loras.lookup(name)
        return {"id": name, "object": "model", "created": created, "owned_by": "kiln",
                "root": service.model_name if lora is None else lora.lora_path,
                "parent": None if lora is None else service.model_name, "max_model_len": service.max_seq_len}

    async def list_models(request: web.Request) -> web.Response:
        service = request.app[SERVICE]
        names = [service.model_name, *service.loras.names]
        return web.json_response({"object": "list", "data": [model_card(service, name) for name in names]})

    async def get_model(request: web.Request) -> web.Response:
        service = request.app[SERVICE]
        name = request.match_info["model"]
        check_model({"model": name}, service)
        return web.json_response(model_card(service, name))

    async def completions(request: web.Request) -> web.StreamResponse:
        service = request.app[SERVICE]
        body = await read_json(request)
        with model_in_use(body, service) as lora:  # not unloaded under it: unloading is refused until it ends
            job = _with_lora(await completion_job(service, body, RequestLimits.from_config(request.app[CONFIG])),
                             lora)
            return await (_answer_stream if job.stream else _answer)(request, job)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        service = request.app[SERVICE]
        body = await read_json(request)
        config = request.app[CONFIG]
        with model_in_use(body, service) as lora:  # not unloaded under it: unloading is refused until it ends
            job = _with_lora(await chat_job(service, body, config.chat_template, RequestLimits.from_config(config),
                                            tool_call_parser(config, service), config.reasoning_parser), lora)
            return await (_answer_stream if job.stream else _answer)(request, job)

    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    lora_routes.add_routes(app)
