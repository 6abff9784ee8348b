"""`kiln serve`: Triton/KServe v2 (HTTP + gRPC) and the OpenAI API over one engine, with metrics."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from kiln.serve.openai.reasoning import REASONING_PARSERS
from kiln.serve.openai.tool_calls import PARSER_NAMES

from .flags import field_flags
from .runtime_args import add_runtime_args, runtime_options


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
    p.add_argument("--max-prompts-per-request", type=int, default=256,
                   help="prompts one /v1/completions request may hold; more is a 400 (default: 256)")
    p.add_argument("--max-n", type=int, default=128, help="largest OpenAI `n` (choices per prompt) (default: 128)")
    p.add_argument("--max-sequences-per-request", type=int, default=1024,
                   help="engine requests one request may start: prompts × n on /v1, batch rows on Triton's infer; "
                        "more is a 400 (default: 1024)")
    p.add_argument("--max-prompt-tokens-per-request", type=int, default=2**20,
                   help="prompt tokens one request may hold, all its prompts together; more is a 400 "
                        "(default: 1048576)")
    p.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                   help="characters one text prompt may hold (on chat, all messages' content together), checked "
                        "before it is tokenized; more is a 400 (default: the larger of 1,000,000 and 8 × the "
                        "engine's max_seq_len)")
    p.add_argument("--api-key-file", default=None,
                   help="read the API key from this file's first line (kept out of `ps`); the environment "
                        "variable KILN_API_KEY works too")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM before they are aborted (default: 30); "
                        "the process exits at most 5 s later, and at once on a second signal")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests admitted but not yet running in the engine; more are refused with 429 + "
                        "Retry-After (gRPC: RESOURCE_EXHAUSTED) (default: 1024)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open HTTP connections; more are answered 503 and closed (default: 1024)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds before an idle HTTP connection, or one that has not sent a complete request "
                        "head, is closed (default: 5)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive; later is a 408 (default: 30)")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host names served besides localhost/127.0.0.1/::1 when listening on a "
                        "loopback address ('*': any); protects against DNS rebinding (default: none)")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated web origins (e.g. http://localhost:3000) whose cross-origin requests "
                        "are served, with CORS headers ('*': any); others get 403 (default: none)")
    p.add_argument("--chat-template", default=None,
                   help="file with a Jinja chat template for /v1/chat/completions (default: the engine's, from its "
                        "tokenizer_config.json or chat_template.jinja; kiln's bundled models ship one)")
    p.add_argument("--tool-call-parser", default=None, choices=PARSER_NAMES,
                   help="the tool-call format /v1/chat/completions reads from the model's answer and constrains it "
                        "to with tool_choice required or a named function: llama3_json ({\"name\": ..., "
                        "\"parameters\": {...}}), hermes (<tool_call>{\"name\": ..., \"arguments\": {...}}"
                        "</tool_call>), deepseek_v3 / deepseek_v31 (DeepSeek's <｜tool▁calls▁begin｜> tokens; V3's "
                        "name after <｜tool▁sep｜> and ```json arguments, V3.1's name before it) or harmony (GPT-OSS: "
                        "reasoning, answer and calls in channels, read from every answer) (default: by architecture: "
                        "Llama/Mistral llama3_json, Qwen2/Qwen3 hermes, DeepSeek by its chat template, GPT-OSS or a "
                        "template that renders <|channel|> harmony)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="read the <think> block of chat answers into message.reasoning_content (vLLM's names; both "
                        "read the same way: the block is open where the prompt ends with <think> or the answer "
                        "starts with it) (default: none, answers as written)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (Hugging Face PEFT directories) served as OpenAI models by these names, "
                        "as name=path or JSON {\"name\": ..., \"path\": ...}; needs --enable-lora (default: none)")
    add_runtime_args(p)
    p.set_defaults(run=run, field_flags=field_flags(p, {"shutdown_timeout_s": "shutdown_timeout",
                                                         "keep_alive_timeout_s": "keep_alive_timeout",
                                                         "body_timeout_s": "body_timeout"}))


def run(args: argparse.Namespace) -> int:
    from kiln.serve.config import ServeConfig
    from kiln.serve.lora_modules import parse_lora_module
    from kiln.serve.server import serve

    template = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        if not path.is_file():
            raise ValueError(f"--chat-template {path}: no such file")
        template = path.read_text(encoding="utf-8")
    config = ServeConfig(engine_dir=args.engine, model_name=args.model_name or "", host=args.host,
                         http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                         api_key=_api_key(args), max_request_bytes=args.max_request_bytes,
                         max_prompts_per_request=args.max_prompts_per_request, max_n=args.max_n,
                         max_sequences_per_request=args.max_sequences_per_request,
                         max_prompt_tokens_per_request=args.max_prompt_tokens_per_request,
                         max_prompt_chars=args.max_prompt_chars,
                         shutdown_timeout_s=args.shutdown_timeout, chat_template=template,
                         chat_template_file=args.chat_template,
                         tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                         max_queued_requests=args.max_queued_requests, max_connections=args.max_connections,
                         keep_alive_timeout_s=args.keep_alive_timeout, body_timeout_s=args.body_timeout,
                         allowed_hosts=_names(args.allowed_hosts), allowed_origins=_names(args.allowed_origins),
                         lora_modules=tuple(parse_lora_module(spec) for spec in args.lora_modules),
                         runtime=runtime_options(args))
    try:
        asyncio.run(serve(config))
    except OSError as e:  # a port in use, an address this machine does not have
        raise ValueError(f"cannot listen: {e}") from None
    return 0


def _names(value: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.split(",") if name.strip())


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else $KILN_API_KEY, else no key."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        path = Path(args.api_key_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {path}: cannot read it: {e}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api-key-file {path}: the file's first line is empty")
        return key
    return args.api_key if args.api_key is not None else (os.environ.get("KILN_API_KEY") or None)
