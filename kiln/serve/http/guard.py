"""What protects the HTTP listener itself: which Host names and web origins it answers, and how many
connections it holds.

A server on a loopback address is reachable from any web page the machine's browser shows: a page can send
requests to 127.0.0.1 (cross-origin) or rebind its own DNS name to 127.0.0.1 (then its requests carry a
foreign Host). So on loopback only loopback Host names are served unless --allowed-hosts adds others, and
a request whose Origin is another site is refused unless --allowed-origins names it (then CORS headers are
sent, as browsers require).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable
from urllib.parse import urlsplit

from aiohttp import web

from kiln.serve.errors import Forbidden

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_CORS_METHODS = "GET, POST, OPTIONS"
_CORS_HEADERS = "Authorization, Content-Type, Content-Encoding, Inference-Header-Content-Length"


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _hostname(host_header: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    return (urlsplit("//" + host_header).hostname or "").lower()


class OriginPolicy:
    """Decides, per request, whether its Host and Origin are served (and which CORS headers it gets)."""

    def __init__(self, bind_host: str, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...]) -> None:
        self.loopback_only = is_loopback(bind_host)
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
        self.allowed_origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)

    def check_host(self, host_header: str | None) -> None:
        # No Host at all (HTTP/1.0 tools) is no browser: browsers always send one.
        if not self.loopback_only or "*" in self.allowed_hosts or host_header is None:
            return
        name = _hostname(host_header)
        if is_loopback(name) or name in self.allowed_hosts:
            return
        raise Forbidden(f"this server listens on a loopback address and does not serve the Host {host_header!r} "
                        f"(a web page may be rebinding its DNS name); allow it with --allowed-hosts", "Host")

    def cors_origin(self, origin: str | None, host_header: str | None) -> str | None:
        """The origin to echo in Access-Control-Allow-Origin, None for a request without a foreign origin;
        Forbidden for a foreign origin that is not allowed."""
        if origin is None or origin == "null" and not self.allowed_origins:
            return None if origin is None else self._refuse(origin)
        parts = urlsplit(origin)
        if parts.netloc.lower() == (host_header or "").lower():
            return None  # same origin: a page served by this very server
        if "*" in self.allowed_origins or origin.rstrip("/").lower() in self.allowed_origins:
            return origin
        return self._refuse(origin)

    @staticmethod
    def _refuse(origin: str) -> None:
        raise Forbidden(f"cross-origin requests from {origin!r} are refused; allow that origin with "
                        f"--allowed-origins", "Origin")


def origin_middleware(policy: OriginPolicy, on_error: Callable[[web.Request, Forbidden], web.StreamResponse]):
    """Checks Host and Origin before anything else (the API key included) and answers CORS preflights."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        try:
            policy.check_host(request.headers.get("Host"))
            allow = policy.cors_origin(request.headers.get("Origin"), request.headers.get("Host"))
        except Forbidden as e:
            return on_error(request, e)
        if allow is not None and request.method == "OPTIONS":
            response: web.StreamResponse = web.Response(status=204)
        else:
            response = await handler(request)
        if allow is not None:
            response.headers.update({"Access-Control-Allow-Origin": allow, "Vary": "Origin",
                                     "Access-Control-Allow-Methods": _CORS_METHODS,
                                     "Access-Control-Allow-Headers": _CORS_HEADERS})
        return response

    return middleware


class _Refused(asyncio.Protocol):
    """A connection over the limit: told so in one HTTP response, then closed."""

    BODY = b'{"error": "too many connections to this server (--max-connections); retry later"}'

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"  # type: ignore[attr-defined]
                        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(self.BODY), self.BODY))
        transport.close()


class LimitedTCPSite(web.TCPSite):
    """A TCPSite that holds at most `max_connections` open connections; more are answered 503 and closed."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int) -> None:
        super().__init__(runner, host, port)
        self._max_connections = max_connections

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner (addresses, cleanup)
        server = self._runner.server
        assert server is not None

        def factory() -> asyncio.Protocol:
            if len(server.connections) >= self._max_connections:
                return _Refused()
            return server()

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(factory, self._host, self._port, backlog=self._backlog,
                                                reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
