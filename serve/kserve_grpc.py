"""Triton's gRPC service `inference.GRPCInferenceService`, on the stubs that tritonclient ships."""

from __future__ import annotations

import grpc

from .config import ServeConfig
from .engine_service import EngineService


def make_server(service: EngineService, config: ServeConfig) -> grpc.aio.Server:
    return grpc.aio.server(options=[("grpc.max_receive_message_length", config.max_request_bytes)])
