"""The HTTP side of `kiln serve`: one aiohttp application for Triton/KServe v2 (`/v2`) and the OpenAI API
(`/v1`) with the API key check, the Host/Origin guard and each protocol's error format; and the metrics
application."""

from __future__ import annotations

from aiohttp import web

from kiln.serve.config import ServeConfig
from kiln.serve.engine_service import EngineService
from kiln.serve.errors import MethodNotAllowed, NotFound, PayloadTooLarge, RequestError
from kiln.serve.http.common import CONFIG, PUBLIC_PATHS, SERVICE, check_api_key, error_response
from kiln.serve.http.guard import OriginPolicy, origin_middleware


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


def _origin_middleware(config: ServeConfig):
    policy = OriginPolicy(config.host, config.allowed_hosts, config.allowed_origins)
    return origin_middleware(policy, lambda request, error: error_response(request.path, error))


def make_http_app(service: EngineService, config: ServeConfig) -> web.Application:
    from kiln.serve.http import utility_routes
    from kiln.serve.kserve import http_routes as kserve_http
    from kiln.serve.openai import api as openai_api

    app = web.Application(client_max_size=config.max_request_bytes,
                          middlewares=[_origin_middleware(config), _protocol_middleware])
    app[SERVICE] = service
    app[CONFIG] = config
    kserve_http.add_routes(app)
    openai_api.add_routes(app)
    utility_routes.add_routes(app)  # /health, /version, /metrics, /tokenize, /detokenize (vLLM's)
    return app


def make_metrics_app(service: EngineService, config: ServeConfig) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=service.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    app = web.Application(middlewares=[_origin_middleware(config)])
    app.router.add_get("/metrics", metrics)
    return app
