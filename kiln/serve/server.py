"""`kiln serve`: one process, one engine, three listeners (HTTP, gRPC, metrics) on one event loop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from pathlib import Path

from aiohttp import web

from kiln.runtime.engine.async_llm import AsyncLLM
from kiln.serve.config import ServeConfig
from kiln.serve.engine_service import EngineService
from kiln.serve.http.app import make_http_app, make_metrics_app
from kiln.serve.http.guard import LimitedTCPSite
from kiln.serve.lora_modules import server_loras
from kiln.serve.openai.chat import chat_reading, chat_template_source

logger = logging.getLogger("kiln.serve")

ENGINE_WATCH_PERIOD_S = 0.5
# What shutdown may take beyond --shutdown-timeout (aborting, closing listeners, stopping the engine thread)
# before the process exits regardless.
SHUTDOWN_GRACE_S = 5.0


def _grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class KilnServer:
    """Starts the listeners over an engine; `stop()` drains requests and closes everything.

    After `start()`, `http_port`, `grpc_port` and `metrics_port` are the ports actually bound.
    """

    def __init__(self, config: ServeConfig, llm: AsyncLLM | None = None) -> None:
        self.config = config
        self.model_name = config.model_name or Path(config.engine_dir).resolve().name
        self._llm = llm
        self.service: EngineService | None = None
        self.http_port = self.grpc_port = self.metrics_port = 0
        self._runners: list[web.AppRunner] = []
        self._grpc = None

    async def start(self) -> None:
        from kiln.serve.kserve import grpc_server as kserve_grpc

        c = self.config
        if self._llm is None:
            self._llm = await asyncio.to_thread(AsyncLLM, c.engine_dir, options=c.runtime)
        try:
            loras = await asyncio.to_thread(server_loras, self._llm, self.model_name, c.lora_modules)
        except ValueError:
            self._llm.shutdown()
            raise
        self.service = EngineService(self._llm, self.model_name, c.max_queued_requests, loras)
        try:
            self.http_port = await self._listen(make_http_app(self.service, c), c.http_port)
            self.metrics_port = await self._listen(make_metrics_app(self.service, c), c.metrics_port)
            self._grpc = kserve_grpc.make_server(self.service, c)
            self.grpc_port = self._add_grpc_port()
            await self._grpc.start()
        except BaseException:
            await self._close_listeners()
            self._llm.shutdown()
            raise
        logger.info("serving %s: HTTP %s:%d, gRPC %s:%d, metrics %s:%d", self.model_name, c.host, self.http_port,
                    c.host, self.grpc_port, c.host, self.metrics_port)

    def _add_grpc_port(self) -> int:
        """Binds the gRPC port; OSError naming it when it is taken (grpcio raises RuntimeError or returns 0)."""
        c = self.config
        address = _grpc_address(c.host, c.grpc_port)
        try:
            port = self._grpc.add_insecure_port(address)
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"gRPC port {c.grpc_port} on {c.host} is in use (choose another --grpc-port), or "
                          f"{c.host} is not an address of this machine")
        return port

    async def _listen(self, app: web.Application, port: int) -> int:
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its request
        # and frees its KV blocks at once instead of at the next write. keepalive_timeout closes idle
        # connections and, from the moment a connection opens, ones that send no complete request head.
        # auto_decompress off: http_body inflates bodies itself, within --max-request-bytes.
        # shutdown_timeout: by the time listeners close, drain has ended (or aborted) every request.
        c = self.config
        # lingering_time: how long the unread rest of a refused body is drained before the connection closes.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                               keepalive_timeout=c.keep_alive_timeout_s, auto_decompress=False,
                               lingering_time=min(2.0, c.body_timeout_s), shutdown_timeout=1.0)
        await runner.setup()
        self._runners.append(runner)
        site = LimitedTCPSite(runner, c.host, port, max_connections=c.max_connections)
        await site.start()
        return runner.addresses[0][1]

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Refuses new requests, gives running ones `drain_timeout_s` (default: --shutdown-timeout) to finish,
        aborts the rest, closes."""
        timeout = self.config.shutdown_timeout_s if drain_timeout_s is None else drain_timeout_s
        if self.service is not None:
            aborted = await self.service.drain(timeout)
            if aborted:
                logger.warning("aborted %d request(s) still running after %.0fs", aborted, timeout)
        await self._close_listeners()
        if self.service is not None:
            self.service.prompt_work.shutdown()
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)

    async def _close_listeners(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()


async def serve(config: ServeConfig) -> None:
    """Runs until SIGTERM or SIGINT, then shuts down gracefully."""
    server = KilnServer(config)
    await server.start()
    print(f"kiln serve: {server.model_name} ready on http://{config.host}:{server.http_port} (HTTP: Triton v2 + "
          f"OpenAI), {config.host}:{server.grpc_port} (gRPC), http://{config.host}:{server.metrics_port}/metrics",
          flush=True)
    print(f"kiln serve: chat template: {chat_template_source(config, server.service.tokenizer)}", flush=True)
    print(f"kiln serve: chat answers: {chat_reading(config, server.service)}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    signalled, failed = asyncio.create_task(stop.wait()), asyncio.create_task(_engine_failure(server))
    await asyncio.wait({signalled, failed}, return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    if failed.done():
        # Health has been unready since the engine stopped; leave, so that a supervisor restarts the server.
        # Every running request has already been failed (503): a dead engine finishes nothing, so no drain.
        print(f"kiln serve: the engine failed ({failed.result()}); exiting", flush=True)
        watchdog = threading.Timer(SHUTDOWN_GRACE_S, _exit_now, ("the shutdown deadline",))
        watchdog.daemon = True
        watchdog.start()
        await server.stop(drain_timeout_s=0)
        raise SystemExit(1)
    failed.cancel()
    print(f"kiln serve: stopping (running requests get {config.shutdown_timeout_s:g} s; a second signal exits "
          f"at once)", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _exit_now, sig)
    # Whatever the load, the process is gone shortly after the timeout, even if a step or a client hangs.
    watchdog = threading.Timer(config.shutdown_timeout_s + SHUTDOWN_GRACE_S, _exit_now, ("the shutdown deadline",))
    watchdog.daemon = True
    watchdog.start()
    await server.stop()
    watchdog.cancel()
    print("kiln serve: stopped", flush=True)


async def _engine_failure(server: KilnServer) -> str:
    """Returns why, once the engine has stopped by itself (its thread crashed, or a tensor-parallel rank died)."""
    llm = server.service.llm
    while llm.is_running:
        await asyncio.sleep(ENGINE_WATCH_PERIOD_S)
    return llm.stop_reason


def _exit_now(reason) -> None:
    """Leaves without cleanup: a second signal, or shutdown running past its deadline."""
    if isinstance(reason, int):
        reason = f"a second {signal.Signals(reason).name}"
    print(f"kiln serve: exiting now ({reason})", flush=True)
    os._exit(1)
