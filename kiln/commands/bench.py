"""`kiln bench serve`: benchmark any OpenAI-compatible server (kiln's own, vLLM, SGLang, TensorRT-LLM's)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark a server", description="Benchmarks.")
    kinds = p.add_subparsers(dest="bench_kind", required=True, metavar="{serve}")
    s = kinds.add_parser(
        "serve", help="load an OpenAI-compatible server with Poisson arrivals",
        description="Send --num-prompts streaming requests to an OpenAI-compatible server, arriving as a Poisson "
                    "process of --request-rate per second, and report time to first token, inter-token latency, "
                    "time per output token and end-to-end latency (mean, p50, p99), and request and token "
                    "throughput. Prompts are random English words, about one token each.")
    s.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    s.add_argument("--request-rate", type=float, required=True, help="requests per second; inf = all at once")
    s.add_argument("--num-prompts", type=int, required=True, help="requests to send")
    s.add_argument("--input-len", type=int, default=128, help="words per prompt (default: 128)")
    s.add_argument("--output-len", type=int, default=128, help="max_tokens per request (default: 128)")
    s.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    s.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                   help="/v1/completions or /v1/chat/completions (default: completions)")
    s.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (servers other than kiln and vLLM may reject it)")
    s.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    s.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    s.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times (default: 0)")
    s.add_argument("--output", default=None, help="also write the results as JSON to this file")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kiln.serve.bench_serve import BenchConfig, format_table, run_bench, to_json

    config = BenchConfig(url=args.url.rstrip("/"), num_prompts=args.num_prompts, request_rate=args.request_rate,
                         input_len=args.input_len, output_len=args.output_len, model=args.model,
                         endpoint=args.endpoint, ignore_eos=not args.no_ignore_eos,
                         max_concurrency=args.max_concurrency, api_key=args.api_key, seed=args.seed)
    summary = asyncio.run(run_bench(config))
    print(format_table(summary))
    if args.output:
        Path(args.output).write_text(json.dumps(to_json(summary), indent=2, allow_nan=False) + "\n")
    if summary["completed"] == 0:
        raise ValueError(f"no request completed: {'; '.join(summary['errors'])}")
    return 0
