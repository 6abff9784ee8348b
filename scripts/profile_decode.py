"""Where one decode step's time goes: torch.profiler over decode steps at a given batch size.

    python scripts/profile_decode.py --engine DIR --batch-size 256 [--context 128] [--steps 5] [--host]

Fills the batch with random prompts of --context tokens, lets every request reach decode, then profiles
--steps engine steps and prints the step's wall time, its GPU kernel time (the difference is the GPU waiting for the host)
and the GPU time per kernel. Run it on the GPU machine (scripts/gpu_check.sh builds the benchmark engine).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kiln.bench.offline import random_prompts
from kiln.runtime import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--context", type=int, default=128, help="prompt tokens per request (default: 128)")
    p.add_argument("--steps", type=int, default=5, help="decode steps to profile (default: 5)")
    p.add_argument("--rows", type=int, default=15, help="kernels to list (default: 15)")
    p.add_argument("--host", action="store_true",
                   help="also profile the host side (cProfile over the same steps): where the CPU time goes")
    args = p.parse_args()
    llm = LLM(args.engine, max_batch_size=args.batch_size)
    engine = llm.engine
    prompts = random_prompts(args.batch_size, args.context, engine.model_config.vocab_size, seed=0)
    params = SamplingParams(max_tokens=10 * args.steps + 50, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    for _ in range(5):  # settle into decode-only steps
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    gpu_total = sum(e.device_time_total for e in events) / args.steps
    print(f"decode step at batch {args.batch_size}, context ~{args.context}: wall {wall * 1e3:.2f} ms/step "
          f"({args.batch_size / wall:.0f} tok/s), GPU kernels {gpu_total / 1e3:.2f} ms/step")
    print(f"{'kernel':<90} {'ms/step':>8} {'share':>6} {'calls/step':>10}")
    for e in events[:args.rows]:
        per_step = e.device_time_total / args.steps
        print(f"{e.key[:90]:<90} {per_step / 1e3:8.3f} {per_step / gpu_total:6.1%} {e.count / args.steps:10.0f}")
    if args.host:
        host_profile(engine, args.steps, args.rows)


def host_profile(engine, steps: int, rows: int) -> None:
    """The Python functions that take the host's time in `steps` engine steps (by own time, then cumulative)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    print(f"host profile over {steps} steps (seconds are totals)")
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)


if __name__ == "__main__":
    main()
