"""The runtime options every command that loads an engine takes (generate, serve, eval, bench)."""

from __future__ import annotations

import argparse

from kiln.runtime.speculative import SpeculativeConfig
from kiln.runtime.speculative.config import METHODS


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
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="read each step's tokens back before scheduling the next (debugging; default on CUDA: "
                        "the next step is scheduled while the GPU runs this one)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-model", default=None, metavar="DIR",
                   help="a draft kiln engine (same vocabulary) that proposes tokens the engine verifies")
    s.add_argument("--speculative-mode", default=None, choices=METHODS,
                   help="draft_model (with --speculative-model) or ngram (prompt lookup, no model)")
    s.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens proposed per request per step (default 4)")
    s.add_argument("--ngram-min", type=int, default=1, help="ngram: shortest suffix looked up (default 1)")
    s.add_argument("--ngram-max", type=int, default=4, help="ngram: longest suffix looked up (default 4)")
    g.add_argument("--no-verify-checksums", action="store_true",
                   help="skip the sha256 check of the engine files against engine.json's manifest (sizes are "
                        "still checked). Without it, files are hashed once and trusted while unchanged")


def runtime_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments for LLM / AsyncLLM / ServeConfig from the options above (a ValueError names a bad
    speculative-decoding flag)."""
    speculative = SpeculativeConfig.from_options(
        speculative_model=args.speculative_model, speculative_mode=args.speculative_mode,
        num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min, ngram_max=args.ngram_max)
    return dict(device=args.device, max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                num_kv_blocks=args.num_kv_blocks, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                cuda_graphs=not args.no_cuda_graphs, async_scheduling=False if args.no_async_scheduling else None,
                verify_checksums=not args.no_verify_checksums,
                speculative_config=speculative)
