"""Triton / KServe v2 over HTTP: health, metadata, config, infer, generate and generate_stream."""

from __future__ import annotations

from aiohttp import web

from .http_app import SERVICE


def add_routes(app: web.Application) -> None:
    async def live(_: web.Request) -> web.Response:
        return web.json_response({})

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({}, status=200 if request.app[SERVICE].ready else 503)

    app.router.add_get("/v2/health/live", live)
    app.router.add_get("/v2/health/ready", ready)
