"""The runtime options every command that loads an engine takes (generate, serve, eval, bench)."""

from __future__ import annotations

import argparse


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("runtime")
    g.add_argument("--device", default=None, help="device to run on (default: the engine's target)")
    g.add_argument("--max-batch-size", type=int, default=None, help="lower the engine's max_batch_size")
    g.add_argument("--max-num-tokens", type=int, default=None, help="lower the engine's max_num_tokens")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV-cache blocks (default: what --kv-cache-memory-fraction allows)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.9,
                   help="share of the memory left after weights and activations that the KV cache takes "
                        "(default: 0.9; CUDA graphs are captured in the rest)")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly (debugging)")
    g.add_argument("--no-verify-checksums", action="store_true",
                   help="skip the sha256 check of the engine files against engine.json's manifest (sizes are "
                        "still checked). Without it, files are hashed once and trusted while unchanged")


def runtime_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments for LLM / AsyncLLM / ServeConfig from the options above."""
    return dict(device=args.device, max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                num_kv_blocks=args.num_kv_blocks, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                cuda_graphs=not args.no_cuda_graphs, verify_checksums=not args.no_verify_checksums)
