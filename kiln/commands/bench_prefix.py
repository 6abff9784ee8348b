"""`kiln bench prefix`: time to first token of a repeated long prefix, recomputed and served from each tier of
the prefix cache (device pool, host tier, disk tier after a restart); kiln/bench/prefix.py does the timing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from .flags import field_flags
from .runtime_args import add_runtime_args, runtime_options


def register(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "prefix", help="a repeated long prefix: time to first token recomputed and from each KV tier",
        description="Load the engine and time one-token requests of a --prefix-len random-token prefix plus a "
                    "fresh --tail-len tail: recomputed, from the device pool's prefix cache, from the host tier "
                    "(with --kv-offloading-size; the device's copy dropped first) and, with --kv-offloading-dir, "
                    "from the disk tier after restarting the engine; --num-iters prefixes, medians reported.")
    p.add_argument("--engine", required=True, help="engine directory made by `kiln build`")
    p.add_argument("--prefix-len", type=int, default=2000, help="shared prefix tokens (default: 2000)")
    p.add_argument("--tail-len", type=int, default=16, help="fresh tokens after it (default: 16)")
    p.add_argument("--num-iters", type=int, default=3, help="prefixes timed (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens (default: 0)")
    p.add_argument("--output", default=None, help="also write the results as JSON to this file")
    add_runtime_args(p)
    p.set_defaults(run=run_prefix, field_flags=field_flags(p))


def run_prefix(args: argparse.Namespace) -> int:
    from kiln.bench.offline import format_table
    from kiln.bench.prefix import PrefixBench, PrefixSpec, format_rows
    from kiln.runtime import LLM

    spec = PrefixSpec(prefix_len=args.prefix_len, tail_len=args.tail_len, num_iters=args.num_iters, seed=args.seed)
    options = runtime_options(args)
    start = time.perf_counter()
    llm = LLM(args.engine, options=options)
    startup = time.perf_counter() - start
    bench = PrefixBench(spec, llm.engine.model_config.vocab_size)
    bench.warm_up(llm)
    bench.time_tiers(llm)
    memory = llm.engine.memory_report
    llm.shutdown()  # the host tier's blocks go to the disk tier, if there is one
    del llm
    if options.kv_offloading_dir is not None:
        _release_device_memory()
        llm = LLM(args.engine, options=options)
        bench.warm_up(llm)
        bench.time_disk(llm)
        llm.shutdown()
    summary = {"benchmark": "prefix", "engine": str(args.engine), "spec": dataclasses.asdict(spec), "startup_s": startup,
               "device": memory.device, "tiers": bench.summary()}
    rows = [("benchmark", f"prefix on {memory.device}"),
            ("prefix / tail tokens", f"{spec.prefix_len} / {spec.tail_len}"),
            ("startup (load to ready) s", f"{startup:.2f}"), *format_rows(summary["tiers"], spec)]
    print(format_table(rows))
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _release_device_memory() -> None:
    """The first engine's tensors go before the restarted one allocates its own (a GPU holds one at a time)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
