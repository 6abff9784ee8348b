"""`kiln serve`: Triton/KServe v2 (HTTP + gRPC) and the OpenAI API over one engine, with metrics."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from .runtime_args import add_runtime_args, runtime_kwargs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve an engine over Triton/KServe v2 (HTTP, gRPC) and the OpenAI API",
        description="Serve an engine: Triton/KServe v2 over HTTP (/v2) and gRPC (tritonclient works unchanged), "
                    "the OpenAI API (/v1) on the HTTP port, Prometheus metrics on the metrics port. SIGTERM "
                    "stops taking requests, lets running ones finish (up to --shutdown-timeout) and exits 0.")
    p.add_argument("--engine", required=True, help="engine directory made by `kiln build`")
    p.add_argument("--model-name", default=None, help="model name in both APIs (default: the engine directory's name)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for all)")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port: /v2 and /v1 (default: 8000)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default: 8001)")
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus /metrics port (default: 8002)")
    p.add_argument("--api-key", default=None,
                   help="require this key: 'Authorization: Bearer KEY' on HTTP, 'authorization' metadata on gRPC "
                        "(health endpoints and /metrics stay open)")
    p.add_argument("--max-request-bytes", type=int, default=8 * 2**20,
                   help="largest request body (default: 8 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM before they are aborted (default: 30)")
    p.add_argument("--chat-template", default=None,
                   help="file with a Jinja chat template for /v1/chat/completions (default: the tokenizer's)")
    add_runtime_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kiln.serve.config import ServeConfig
    from kiln.serve.server import serve

    template = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        if not path.is_file():
            raise ValueError(f"--chat-template {path}: no such file")
        template = path.read_text(encoding="utf-8")
    config = ServeConfig(engine_dir=args.engine, model_name=args.model_name or "", host=args.host,
                         http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                         api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                         shutdown_timeout_s=args.shutdown_timeout, chat_template=template,
                         **runtime_kwargs(args))
    try:
        asyncio.run(serve(config))
    except OSError as e:  # a port in use, an address this machine does not have
        raise ValueError(f"cannot listen: {e}") from None
    return 0
