"""What every HTTP route module of `kiln serve` shares: the app keys, the error format of each protocol, the
API key check and reading a request body. Route modules import this, never the module that assembles the
app (http_app), so no two modules import each other."""

from __future__ import annotations

import hmac

from aiohttp import web

from kiln.serve.config import ServeConfig
from kiln.serve.engine_service import EngineService
from kiln.serve.errors import Overloaded, RequestError, RequestTimeout, Unauthorized
from kiln.serve.http.body import parse_json_object, read_body

SERVICE = web.AppKey("service", EngineService)
CONFIG = web.AppKey("config", ServeConfig)
# Probes (load balancers, Kubernetes) cannot send a key; these say nothing about the model. /metrics is open
# as on the metrics port.
PUBLIC_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/health", "/metrics"})


def error_response(path: str, error: RequestError) -> web.Response:
    """OpenAI's error object under /v1, Triton's `{"error": message}` elsewhere."""
    if path.startswith("/v1"):
        body = {"error": {"message": error.message, "type": error.openai_type, "param": error.param,
                          "code": getattr(error, "openai_code", None) or error.status}}
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


async def read_request_body(request: web.Request) -> bytes:
    """The body, decoded, within the server's time and size limits (http_body.read_body)."""
    config = request.app[CONFIG]
    return await read_body(request, timeout_s=config.body_timeout_s, max_bytes=config.max_request_bytes)


async def read_json(request: web.Request) -> dict:
    """The request body as a JSON object, or a RequestError saying what is wrong with it."""
    return parse_json_object(await read_request_body(request))
