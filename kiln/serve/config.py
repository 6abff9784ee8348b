"""What `kiln serve` is told: where to listen, what to serve, and its limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.options import RuntimeOptions
from kiln.serve.openai.reasoning import REASONING_PARSERS
from kiln.serve.openai.tool_calls import PARSER_NAMES


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
    # Work one request may ask for (serve/limits.py); more is a 400 before anything is tokenized.
    max_prompts_per_request: int = 256  # prompts of one /v1/completions request
    max_n: int = 128  # OpenAI `n`: choices per prompt
    max_sequences_per_request: int = 1024  # engine requests: prompts × n (OpenAI), batch rows (Triton)
    max_prompt_tokens_per_request: int = 2**20  # prompt tokens, each prompt counted once
    # Characters of one text prompt (chat: all messages' content), checked before it is tokenized or templated.
    # None: the larger of 1,000,000 and 8 × the engine's max_seq_len (limits.default_max_prompt_chars).
    max_prompt_chars: int | None = None
    shutdown_timeout_s: float = 30.0  # SIGTERM: running requests get this long, then are aborted
    # Abuse limits (see docs/serving.md, "Held under abuse"): admission, connections, time.
    max_queued_requests: int = 1024  # admitted but not yet running; more get 429 / RESOURCE_EXHAUSTED
    max_connections: int = 1024  # open HTTP connections; more are answered 503 and closed
    keep_alive_timeout_s: float = 5.0  # idle connections, and ones that send no complete request head, close
    body_timeout_s: float = 30.0  # a request body must arrive within this (408)
    allowed_hosts: tuple[str, ...] = ()  # Host names served besides loopback ones, on a loopback bind ("*": any)
    allowed_origins: tuple[str, ...] = ()  # web origins whose cross-origin requests are served ("*": any)
    chat_template: str | None = None  # Jinja text that replaces the tokenizer's chat template
    chat_template_file: str | None = None  # the file chat_template was read from (--chat-template), for the log
    # the tool-call format the chat API reads and constrains (serve/openai/tool_calls.py's PARSER_NAMES); None: the
    # engine architecture's (Llama/Mistral: llama3_json, Qwen2/Qwen3: hermes, DeepSeek: by its chat template)
    tool_call_parser: str | None = None
    # whether chat answers' <think> block becomes reasoning_content (serve/openai/reasoning.py's REASONING_PARSERS,
    # vLLM's names deepseek_r1 and qwen3, read alike); None: answers are read as they are (vLLM's default too)
    reasoning_parser: str | None = None
    # LoRA adapters served by name (--lora-modules name=path): each is a `model` of the OpenAI API; needs
    # runtime.enable_lora. More come and go while serving through /v1/load_lora_adapter and /v1/unload_lora_adapter.
    lora_modules: tuple[tuple[str, str], ...] = ()
    # how the engine is run: device, lower limits, KV-cache size, CUDA graphs, speculative decoding
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.runtime, RuntimeOptions):
            raise ValueError(f"ServeConfig.runtime={self.runtime!r} is invalid: must be a RuntimeOptions")
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
        if self.api_key is not None and not self.api_key.isascii():
            raise ValueError("ServeConfig.api_key must be ASCII (HTTP headers and gRPC metadata carry it)")
        for name in ("max_queued_requests", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServeConfig.{name}={value!r} is invalid: must be a positive integer")
        for name in ("keep_alive_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServeConfig.{name}={getattr(self, name)!r} is invalid: must be > 0 seconds")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"ServeConfig.reasoning_parser={self.reasoning_parser!r} is invalid: must be one of "
                             f"{', '.join(REASONING_PARSERS)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSER_NAMES:
            raise ValueError(f"ServeConfig.tool_call_parser={self.tool_call_parser!r} is invalid: must be one of "
                             f"{', '.join(PARSER_NAMES)}")
        for name in ("max_prompts_per_request", "max_n", "max_sequences_per_request", "max_prompt_tokens_per_request",
                     "max_prompt_chars"):
            value = getattr(self, name)
            if name == "max_prompt_chars" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServeConfig.{name}={value!r} is invalid: must be a positive integer")
        names = [name for name, _ in self.lora_modules]
        if names and not self.runtime.enable_lora:
            raise ValueError(f"--lora-modules {' '.join(names)} needs --enable-lora")
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names must differ, got {', '.join(names)}")
        if self.model_name and self.model_name in names:
            raise ValueError(f"--lora-modules name {self.model_name!r} is the base model's name (--model-name)")
