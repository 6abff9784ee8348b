"""`kiln bench latency|throughput|prefix|serve`: the engine offline (batch 1, or many requests queued at once), or any
OpenAI-compatible server (kiln's own, vLLM, SGLang, TensorRT-LLM's) under load."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from . import bench_prefix
from .flags import field_flags
from .runtime_args import add_runtime_args, runtime_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark an engine or a server", description="Benchmarks.")
    kinds = p.add_subparsers(dest="bench_kind", required=True, metavar="{latency,throughput,prefix,serve}")
    lat = kinds.add_parser(
        "latency", help="batch 1: time to first token, decode tokens/s, inter-token latency",
        description="Load the engine and generate for one random prompt of --input-len tokens, --output-len tokens "
                    "(EOS ignored), --num-iters times after --warmup untimed runs; report time to first token, "
                    "decode tokens/s and inter-token latency p50/p99, plus startup and graph-capture time.")
    thr = kinds.add_parser(
        "throughput", help="many requests at once: output and total tokens/s",
        description="Load the engine, queue --num-requests random prompts of --input-len tokens at once, each "
                    "generating --output-len tokens (EOS ignored), after one untimed warm-up batch; report output "
                    "and total (prompt + output) tokens/s, plus startup and graph-capture time.")
    for q in (lat, thr):
        q.add_argument("--engine", required=True, help="engine directory made by `kiln build`")
        q.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
        q.add_argument("--output-len", type=int, default=128, help="generated tokens (default: 128)")
        q.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: 0)")
        q.add_argument("--prompt-file", default=None, metavar="FILE",
                       help="prompts are --input-len-token windows of this text (default: random tokens); "
                            "speculative decoding needs real text to guess from")
        q.add_argument("--output", default=None, help="also write the results as JSON to this file")
        q.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="LoRA adapters (Hugging Face PEFT directories) as name=path or JSON {\"name\": ..., "
                            "\"path\": ...}; requests take the first --num-loras of them round-robin; needs "
                            "--enable-lora (default: none)")
        q.add_argument("--num-loras", type=int, default=None, metavar="K",
                       help="distinct adapters the requests use, the first K of --lora-modules (0: every request "
                            "runs the base model; default: all of them)")
        add_runtime_args(q)
    lat.add_argument("--num-iters", type=int, default=3, help="timed runs (default: 3)")
    lat.add_argument("--warmup", type=int, default=1, help="untimed runs first (default: 1)")
    lat.set_defaults(run=run_offline, field_flags=field_flags(lat))
    thr.add_argument("--num-requests", type=int, default=1000, help="requests queued at once (default: 1000)")
    thr.set_defaults(run=run_offline, num_iters=1, warmup=1, field_flags=field_flags(thr))
    bench_prefix.register(kinds)
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
    s.set_defaults(run=run, field_flags=field_flags(s))


def run(args: argparse.Namespace) -> int:
    from kiln.bench.serve_client import BenchConfig, format_table, run_bench, to_json

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


def run_offline(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    import torch

    from kiln.bench.lora import bench_loras
    from kiln.bench.offline import BenchSpec, format_table, run_latency, run_throughput
    from kiln.runtime import LLM
    from kiln.serve.lora_modules import parse_lora_module

    from .text_file import read_text_arg

    spec = BenchSpec(input_len=args.input_len, output_len=args.output_len,
                     num_requests=getattr(args, "num_requests", 1), num_iters=args.num_iters, warmup=args.warmup,
                     seed=args.seed,
                     prompt_text=read_text_arg(args.prompt_file, "--prompt-file") if args.prompt_file else None)
    options = runtime_options(args)
    loras = bench_loras([parse_lora_module(m) for m in args.lora_modules], args.num_loras, options.enable_lora)
    start = time.perf_counter()
    llm = LLM(args.engine, options=options)
    startup = time.perf_counter() - start
    engine, runtime = llm.engine, llm.engine.runtime
    run_kind = run_latency if args.bench_kind == "latency" else run_throughput
    results = run_kind(llm, spec, loras)
    device = runtime.device
    summary = {
        "benchmark": args.bench_kind, "engine": str(args.engine), "spec": dataclasses.asdict(spec),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(runtime.dtype).removeprefix("torch."), "max_batch_size": runtime.max_batch_size,
        "max_num_tokens": runtime.max_num_tokens, "num_kv_blocks": runtime.num_kv_blocks,
        "startup_s": startup, "graph_capture_s": engine.graph_capture_seconds,
        "memory": dataclasses.asdict(engine.memory_report), **results,
        "speculation": llm.speculation_stats(),
        "lora": {"enable_lora": runtime.enable_lora, **loras.to_json(), "stats": llm.lora_stats()},
    }
    rows = [("benchmark", f"{args.bench_kind} on {summary['device']} ({summary['dtype']})"),
            ("input / output tokens", f"{spec.input_len} / {spec.output_len}"),
            ("startup (load to ready) s", f"{startup:.2f}"),
            ("CUDA graph capture s", f"{engine.graph_capture_seconds:.2f}")]
    if runtime.enable_lora:
        names = ", ".join(a.lora_name for a in loras.adapters) or "none: every request runs the base model"
        rows.append(("LoRA adapters (round-robin)", f"{len(loras.adapters)} ({names})"))
    if args.bench_kind == "latency":
        rows += [("time to first token ms", f"{results['ttft_ms']:.2f}"),
                 ("decode tokens/s", f"{results['decode_tokens_per_s']:.1f}"),
                 ("inter-token latency ms p50 / p99", f"{results['itl_p50_ms']:.2f} / {results['itl_p99_ms']:.2f}")]
    else:
        rows += [("requests", f"{spec.num_requests} (max batch {runtime.max_batch_size})"),
                 ("elapsed s", f"{results['elapsed_s']:.2f}"),
                 ("output tokens/s", f"{results['output_tokens_per_s']:.1f}"),
                 ("total tokens/s", f"{results['total_tokens_per_s']:.1f}"),
                 ("requests/s", f"{results['requests_per_s']:.2f}")]
    spec_stats = summary["speculation"]
    if spec_stats is not None:
        config = engine.speculator.config
        per_position = " ".join(f"{a:.2f}" for a in spec_stats["acceptance_per_position"])
        rows += [("speculative decoding", f"{config.method}, K = {config.num_speculative_tokens}"),
                 ("mean accepted length", f"{spec_stats['mean_accepted_length']:.2f}"),
                 ("acceptance rate", f"{spec_stats['acceptance_rate']:.3f} (per position: {per_position})")]
    print(format_table(rows))
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    return 0
