"""What `kiln serve` is told: where to listen, what to serve, and its limits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    """Validated at construction; invalid values raise ValueError naming the field.

    Ports may be 0 (the OS picks a free one; the server reports what it bound).
    """

    engine_dir: str
    model_name: str = ""  # default: the engine directory's name
    host: str = "127.0.0.1"  # loopback unless told otherwise: safe by default
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    api_key: str | None = None  # required as `Authorization: Bearer KEY` (HTTP) / `authorization` metadata (gRPC)
    max_request_bytes: int = 8 * 2**20
    shutdown_timeout_s: float = 30.0  # SIGTERM: running requests get this long, then are aborted
    chat_template: str | None = None  # Jinja text that replaces the tokenizer's chat template
    # runtime overrides (None: the engine's build limits / what memory allows)
    device: str | None = None
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.9
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            if not isinstance(port, int) or not 0 <= port <= 65535:
                raise ValueError(f"ServeConfig.{name}={port!r} is invalid: must be a port number in [0, 65535]")
        nonzero = [p for p in (self.http_port, self.grpc_port, self.metrics_port) if p]
        if len(set(nonzero)) != len(nonzero):
            raise ValueError(f"the HTTP, gRPC and metrics ports must differ, got {self.http_port}, "
                             f"{self.grpc_port}, {self.metrics_port}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"ServeConfig.max_request_bytes={self.max_request_bytes} is invalid: must be >= 1024")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"ServeConfig.shutdown_timeout_s={self.shutdown_timeout_s} is invalid: must be >= 0")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("ServeConfig.api_key is empty; leave it out to serve without a key")
