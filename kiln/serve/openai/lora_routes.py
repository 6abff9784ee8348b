"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters added and removed while serving
(behind the API key like every /v1 route; only with --enable-lora). An adapter is read and checked on a worker
thread before it is served; one that running requests use is refused unloading (409), never cut off."""

from __future__ import annotations

import asyncio

from aiohttp import web

from kiln.serve.client_json import shown
from kiln.serve.errors import InvalidRequest, NotFound
from kiln.serve.http.common import SERVICE, read_json
from kiln.serve.lora_modules import LoRAModules


def _loras(request: web.Request) -> LoRAModules:
    loras = request.app[SERVICE].loras
    if not loras.enabled:
        raise NotFound(f"{request.path} needs the server started with --enable-lora")
    return loras


def _name(body: dict, field: str, allowed: set[str]) -> str:
    for key, value in body.items():
        if key not in allowed and value is not None:
            raise InvalidRequest(f"'{key}' is not supported here (got {shown(value)}); the fields are "
                                 f"{', '.join(sorted(allowed))}", key)
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{field}={shown(value)} is invalid: must be a non-empty string", field)
    return value


def add_routes(app: web.Application) -> None:
    async def load(request: web.Request) -> web.Response:
        loras = _loras(request)
        body = await read_json(request)
        name = _name(body, "lora_name", {"lora_name", "lora_path", "load_inplace"})
        path = _name(body, "lora_path", {"lora_name", "lora_path", "load_inplace"})
        if body.get("load_inplace"):
            raise InvalidRequest("load_inplace is not supported: unload the adapter, then load it", "load_inplace")
        await asyncio.to_thread(loras.add, name, path)  # reads the adapter's tensors: off the event loop
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: web.Request) -> web.Response:
        loras = _loras(request)
        body = await read_json(request)
        name = _name(body, "lora_name", {"lora_name", "lora_int_id"})
        loras.remove(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
