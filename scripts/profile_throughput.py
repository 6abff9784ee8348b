"""Where a throughput run's time goes: a whole `kiln bench throughput`-style run under torch.profiler.

    python scripts/profile_throughput.py --engine DIR [--input-len 128] [--output-len 128] [--num-requests 3000]
    python scripts/profile_throughput.py --engine DIR --input-len 2048 --output-len 1 --num-requests 1 --repeat 5
                                                      # one long prompt's prefill step: where its TTFT goes

Queues every request at once (as `kiln bench throughput` does), runs one untimed warm-up wave, then the timed run
twice: plain (output tok/s, steps split into those that carry prompt tokens and decode-only ones, with their wall
time) and under the profiler (GPU kernel time per kernel over the whole run, and the host's share: wall time the GPU
spent idle). Run it on the GPU machine on an engine built by scripts/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

from kiln.bench.offline import random_prompts
from kiln.runtime import LLM, SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(engine, prompts, output_len: int) -> dict:
    """Adds every prompt, steps until all finish; wall time of steps with prompt work and of decode-only ones."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    sched = engine.scheduler
    times: list[float] = []
    mixed = decode = 0.0
    n_mixed = n_decode = 0
    _sync()
    start = time.perf_counter()
    while sched.waiting or sched.running:
        # Waiting requests start only where the batch has room; a running one may still be mid-prompt (chunked).
        room = len(sched.running) < engine.runtime.max_batch_size
        prompt_work = (bool(sched.waiting) and room) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)
        t0 = time.perf_counter()
        engine.step(final_only=True)  # as LLM.generate steps
        dt = time.perf_counter() - t0
        times.append(dt)
        if prompt_work:
            mixed, n_mixed = mixed + dt, n_mixed + 1
        else:
            decode, n_decode = decode + dt, n_decode + 1
    _sync()
    wall = time.perf_counter() - start
    return {"wall": wall, "tok_s": len(prompts) * output_len / wall, "mixed_s": mixed, "mixed_steps": n_mixed,
            "decode_s": decode, "decode_steps": n_decode,
            "slowest_ms": [round(t * 1e3, 1) for t in sorted(times)[-6:]], "median_ms": round(sorted(times)[len(times) // 2] * 1e3, 1)}


@contextmanager
def launches_watched() -> Iterator[dict]:
    """Within the block: Triton kernels compiled or loaded from its cache (first launches of a specialization), new
    CUDA memory segments (cudaMalloc), gc collections of the oldest generation."""
    from triton import knobs

    seen = {"triton_compiled": 0, "triton_loaded": 0, "cuda_mallocs": 0, "gc_gen2": 0, "gc_gen2_s": 0.0}
    gc_start: list[float] = []

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
        seen["triton_loaded" if cache_hit else "triton_compiled"] += 1

    def gc_hook(phase: str, info: dict) -> None:
        if info.get("generation") == 2:
            if phase == "start":
                gc_start.append(time.perf_counter())
            elif gc_start:
                seen["gc_gen2"] += 1
                seen["gc_gen2_s"] += time.perf_counter() - gc_start.pop()

    segments = torch.cuda.memory_stats().get("segment.all.allocated", 0) if torch.cuda.is_available() else 0
    before, knobs.compilation.listener = knobs.compilation.listener, listener
    gc.callbacks.append(gc_hook)
    try:
        yield seen
    finally:
        knobs.compilation.listener = before
        gc.callbacks.remove(gc_hook)
        if torch.cuda.is_available():
            seen["cuda_mallocs"] = torch.cuda.memory_stats().get("segment.all.allocated", 0) - segments
        seen["gc_gen2_s"] = round(seen["gc_gen2_s"], 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=3000)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--repeat", type=int, default=1, help="plain runs before the profiled one (each reported)")
    p.add_argument("--cprofile-runs", type=int, nargs="*", default=[], help="plain runs (1-based) to run under cProfile")
    p.add_argument("--gc-off-from", type=int, default=0, help="gc.disable() before this plain run (1-based; 0: never)")
    p.add_argument("--unfreeze", action="store_true", help="gc.unfreeze() once loaded (how kiln ran before heap.py)")
    p.add_argument("--host", action="store_true", help="also a cProfile of one more run: where the host's time goes")
    p.add_argument("--fp8-exact-accum", action="store_true",
                   help="cuBLASLt's FP8 GEMMs promoting their sums to float32 (triton_scaled_linear.FP8_FAST_ACCUM off)")
    p.add_argument("--no-decode-split", action="store_true",
                   help="mixed steps' decode rows attend with the prompts, in one unified kernel (no decode_prefix.py)")
    p.add_argument("--no-profile", action="store_true", help="the plain runs only")
    args = p.parse_args()
    if args.fp8_exact_accum:
        from kiln.plugins import triton_scaled_linear
        triton_scaled_linear.FP8_FAST_ACCUM = False  # before the engine loads: its graphs capture the choice
    if args.no_decode_split:
        from kiln.model_defs.layers import context
        context.decode_prefix = lambda *a: None
    llm = LLM(args.engine)
    if args.unfreeze:
        gc.unfreeze()
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    warmup = min(engine.runtime.max_batch_size, args.num_requests)
    run(engine, random_prompts(warmup, args.input_len, vocab, seed=1), 8)  # warm-up wave
    for i in range(args.repeat):
        if args.gc_off_from and i + 1 == args.gc_off_from:
            gc.collect()
            gc.disable()
        cprof = None
        if i + 1 in args.cprofile_runs:
            import cProfile
            cprof = cProfile.Profile()
            cprof.enable()
        prompts = random_prompts(args.num_requests, args.input_len, vocab, seed=10 + i)  # new ones: no prefix hits
        with launches_watched() as seen:
            plain = run(engine, prompts, args.output_len)
        if cprof is not None:
            import pstats
            cprof.disable()
            pstats.Stats(cprof).sort_stats("tottime").print_stats(20)
        seen.update(slowest_ms=plain["slowest_ms"], median_ms=plain["median_ms"])
        print(f"plain run {i + 1}: {plain['tok_s']:.0f} output tok/s, wall {plain['wall']:.2f} s: steps with prompt "
              f"work {plain['mixed_steps']} ({plain['mixed_s']:.2f} s), decode-only {plain['decode_steps']} "
              f"({plain['decode_s']:.2f} s); {seen}", flush=True)
    if args.no_profile:
        return
    prompts = random_prompts(args.num_requests, args.input_len, vocab, seed=0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prof_run = run(engine, prompts, args.output_len)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    gpu_total = sum(e.device_time_total for e in events) / 1e6
    print(f"profiled: {prof_run['tok_s']:.0f} tok/s, wall {prof_run['wall']:.2f} s, GPU kernels {gpu_total:.2f} s "
          f"({gpu_total / prof_run['wall']:.0%} busy)")
    print(f"{'kernel':<100} {'total s':>8} {'share':>6} {'calls':>8} {'us/call':>8}")
    for e in events[:args.rows]:
        t = e.device_time_total / 1e6
        print(f"{e.key[:100]:<100} {t:8.3f} {t / gpu_total:6.1%} {e.count:8d} {e.device_time_total / max(e.count, 1):8.1f}")


    if args.host:
        import cProfile
        import pstats

        prof_host = cProfile.Profile()
        prof_host.enable()
        run(engine, random_prompts(args.num_requests, args.input_len, vocab, seed=1000), args.output_len)
        prof_host.disable()
        stats = pstats.Stats(prof_host)
        stats.sort_stats("tottime").print_stats(args.rows)
        stats.sort_stats("cumulative").print_stats(args.rows + 15)


if __name__ == "__main__":
    main()
