"""`kiln build`: a Hugging Face checkpoint into an engine directory."""

from __future__ import annotations

import argparse
import json
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build a Hugging Face checkpoint into an engine",
                       description="Convert, fuse and cast a Hugging Face checkpoint into a kiln engine directory "
                                   "(engine.json, rank0.safetensors, tokenizer/).")
    p.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory (config.json, weights, "
                                                       "tokenizer files)")
    p.add_argument("--output", required=True, help="engine directory to write (replaced if it is an engine)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weight and activation dtype; auto = the checkpoint's torch_dtype (default: auto)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="device type the engine targets; cuda records this GPU (default: cpu)")
    p.add_argument("--max-batch-size", type=int, default=64, help="most requests per step (default: 64)")
    p.add_argument("--max-num-tokens", type=int, default=2048,
                   help="most tokens per step, prefill chunks and decodes together (default: 2048)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="most tokens per request, prompt + output (default: the model's max_position_embeddings)")
    p.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    p.add_argument("--dummy-weights", action="store_true",
                   help="random weights from config.json alone, no weight files needed (for benchmarks)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    config = BuildConfig(dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size,
                         max_num_tokens=args.max_num_tokens, max_seq_len=args.max_seq_len,
                         kv_block_size=args.kv_block_size, dummy_weights=args.dummy_weights)
    start = time.perf_counter()
    out = build_engine(args.checkpoint, args.output, config)
    dtype = json.loads((out / "engine.json").read_text())["build_config"]["dtype"]
    picked = f" ({dtype}, picked by --dtype auto for {args.device})" if args.dtype == "auto" else f" ({dtype})"
    print(f"engine written to {out}{picked} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0
