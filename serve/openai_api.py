"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

from aiohttp import web


def add_routes(app: web.Application) -> None:
    pass
