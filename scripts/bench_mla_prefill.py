"""Time to first token of an MLA model (DeepSeek V2 / V3) per prompt length, MLA's explicit prefill against the
absorbed form, in one process on one engine (docs/performance.md's table).

`model_defs/layers/mla_split.EXPLICIT_MIN_QUERY` decides which sequences of an eager step run explicitly; it is
read at every step, so the script switches it between runs: the threshold (explicit from 32 queries) and off
(every sequence absorbed). Each run is one request of random tokens (no prefix-cache hit) and one new token;
the median of `--repeats` after `--warmup`. Prompts of up to 512 tokens replay prefill graphs on CUDA, which stay
absorbed. Per length it also prints how many new CUDA memory segments the timed runs allocated (an allocator
that keeps growing shows up as host time), and `--profile N` prints torch.profiler's tables (GPU time, then
host time) for one prefill of N tokens in each form.

    kiln build --checkpoint benchmarks/configs/deepseek-v2-lite --output /tmp/dsv2 --dummy-weights \\
        --dtype bfloat16 --device cuda --max-batch-size 256 --max-num-tokens 8192 --max-seq-len 4224
    python scripts/bench_mla_prefill.py --engine /tmp/dsv2 --profile 1024
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kiln.model_defs.layers import mla_split
from kiln.runtime import LLM, SamplingParams

FORMS = {"explicit": mla_split.EXPLICIT_MIN_QUERY, "absorbed": 1 << 62}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _segments() -> int:
    return torch.cuda.memory_stats().get("segment.all.allocated", 0) if torch.cuda.is_available() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--lengths", default="64,256,600,1024,2048,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", default="", help="prompt lengths to profile in both forms, comma-separated")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",") if n]
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with LLM(args.engine, enable_prefix_caching=False) as llm:
        vocab = llm.engine.model_config.vocab_size

        def run(n: int) -> float:
            ids = [rng.randrange(vocab) for _ in range(n)]
            _sync()
            started = time.perf_counter()
            llm.generate(ids, params)
            _sync()
            return (time.perf_counter() - started) * 1e3

        print("| prompt tokens | " + " | ".join(f"{name}, ms (new segments)" for name in FORMS) + " |")
        print("| --- |" + " --- |" * len(FORMS))
        for n in lengths:
            cells = []
            for threshold in FORMS.values():
                mla_split.EXPLICIT_MIN_QUERY = threshold
                for _ in range(args.warmup):
                    run(n)
                before = _segments()
                times = [run(n) for _ in range(args.repeats)]
                cells.append(f"{statistics.median(times):.1f} (min {min(times):.1f}; {_segments() - before})")
            print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
        for n in [int(x) for x in args.profile.split(",") if x]:
            for name, threshold in FORMS.items():
                mla_split.EXPLICIT_MIN_QUERY = threshold
                run(n)
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=activities) as prof:
                    ms = run(n)
                table = prof.key_averages()
                print(f"\n== {name}, {n} tokens: {ms:.1f} ms")
                if torch.cuda.is_available():
                    print(table.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
                print(table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        mla_split.EXPLICIT_MIN_QUERY = FORMS["explicit"]


if __name__ == "__main__":
    main()
