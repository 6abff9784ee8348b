"""The HTTP side of `kiln serve`: one aiohttp application for Triton/KServe v2 (`/v2`) and the OpenAI API
(`/v1`), with the API key check and the error format of each protocol; and the metrics application."""

from __future__ import annotations

import hmac

from aiohttp import web

from .config import ServeConfig
from .engine_service import EngineService
from .errors import (
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RequestError,
    RequestTimeout,
    Unauthorized,
)
from .http_body import parse_json_object, read_body
from .http_guard import OriginPolicy, origin_middleware

SERVICE = web.AppKey("service", EngineService)
CONFIG = web.AppKey("config", ServeConfig)
# Probes (load balancers, Kubernetes) cannot send a key; these say nothing about the model.
PUBLIC_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/health"})


def error_response(path: str, error: RequestError) -> web.Response:
    """OpenAI's error object under /v1, Triton's `{"error": message}` elsewhere."""
    if path.startswith("/v1"):
        body = {"error": {"message": error.message, "type": error.openai_type, "param": error.param,
                          "code": error.status}}
    else:
        body = {"error": error.message}
    response = web.json_response(body, status=error.status)
    if isinstance(error, Overloaded):
        response.headers["Retry-After"] = str(error.retry_after_s)
    if isinstance(error, RequestTimeout):
        response.force_close()  # the rest of that body may never come: do not wait for it on this connection
    return response


def check_api_key(config: ServeConfig, authorization: str | None) -> None:
    """Raises Unauthorized unless `authorization` is `Bearer <the key>` (or no key is configured)."""
    if config.api_key is None:
        return
    expected = f"Bearer {config.api_key}".encode()
    # surrogateescape: a header of non-ASCII (even undecodable) bytes is a wrong key, never a crash.
    given = None if authorization is None else authorization.encode("utf-8", "surrogateescape")
    if given is None or not hmac.compare_digest(given, expected):
        raise Unauthorized("missing or wrong API key: send the header 'Authorization: Bearer <key>'")


@web.middleware
async def _protocol_middleware(request: web.Request, handler):
    try:
        if request.path not in PUBLIC_PATHS:
            check_api_key(request.app[CONFIG], request.headers.get("Authorization"))
        return await handler(request)
    except RequestError as e:
        return error_response(request.path, e)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[CONFIG].max_request_bytes
        return error_response(request.path, PayloadTooLarge(
            f"request body is larger than the server's limit of {limit} bytes (--max-request-bytes)"))
    except web.HTTPNotFound:
        return error_response(request.path, NotFound(f"no route for {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed as e:
        return error_response(request.path, MethodNotAllowed(
            f"{request.method} is not allowed on {request.path}; use {', '.join(e.allowed_methods)}"))


async def read_request_body(request: web.Request) -> bytes:
    """The body, decoded, within the server's time and size limits (http_body.read_body)."""
    config = request.app[CONFIG]
    return await read_body(request, timeout_s=config.body_timeout_s, max_bytes=config.max_request_bytes)


async def read_json(request: web.Request) -> dict:
    """The request body as a JSON object, or a RequestError saying what is wrong with it."""
    return parse_json_object(await read_request_body(request))


def _origin_middleware(config: ServeConfig):
    policy = OriginPolicy(config.host, config.allowed_hosts, config.allowed_origins)
    return origin_middleware(policy, lambda request, error: error_response(request.path, error))


def make_http_app(service: EngineService, config: ServeConfig) -> web.Application:
    from . import kserve_http, openai_api

    app = web.Application(client_max_size=config.max_request_bytes,
                          middlewares=[_origin_middleware(config), _protocol_middleware])
    app[SERVICE] = service
    app[CONFIG] = config
    kserve_http.add_routes(app)
    openai_api.add_routes(app)
    return app


def make_metrics_app(service: EngineService, config: ServeConfig) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=service.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    app = web.Application(middlewares=[_origin_middleware(config)])
    app.router.add_get("/metrics", metrics)
    return app
