"""Times kiln's decode attention kernel (one CUDA GPU, inside CUDA graphs as the runtime runs decode steps) over a
bfloat16 and an FP8 KV cache, Llama-3.1-8B's heads (32 query, 8 kv, dim 128), block size 16, blocks scattered:
the KV bytes read per second is the figure to watch (decode attention is memory-bound).

    python scripts/bench_attention.py                       # the launch settings the runtime picks
    python scripts/bench_attention.py --sweep               # FP8 (or `--sweep all`): other launch settings too
    python scripts/bench_attention.py --variant f16         # FP8 tiles converted through float16 (or: direct,
                                                            # f16dots: the dots in float16)
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import pathlib
import sys
from dataclasses import replace

import torch

from kiln.plugins import triton_attention as ta

HQ, HK, D, BLOCK = 32, 8, 128, 16


# How an FP8 tile becomes q's dtype: through float32 (the kernel's way), directly, or through float16; or
# "f16dots": the tiles become float16 (one packed conversion per two values on sm_90) and q meets them there,
# the dots in float16 (exact for every FP8 value; q rounded to float16, which overflows past 65,504).
VARIANTS = {"f32": "k.to(tl.float32)", "direct": "k", "f16": "k.to(tl.float16)", "f16dots": None}


def load_variant(name: str):
    """triton_attention with its FP8 tile conversion replaced (a module loaded from edited source)."""
    global ta
    if name == "f32":
        return
    path = pathlib.Path(ta.__file__)
    src = path.read_text()
    for t in ("k", "v"):
        old = f"{t} = {t}.to(tl.float32).to(q.dtype)"
        assert old in src, old
        new = f"{t} = {t}.to(tl.float16)" if name == "f16dots" else f"{t} = {VARIANTS[name].replace('k', t, 1)}.to(q.dtype)"
        src = src.replace(old, new)
    if name == "f16dots":  # p already meets v in v's dtype
        old = "scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)"
        assert old in src, old
        src = src.replace(old, "scores = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION)")
    target = path.with_name(f"_attention_variant_{name}.py")
    target.write_text(src)
    spec = importlib.util.spec_from_file_location(f"kiln.plugins._attention_variant_{name}", target)
    ta = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ta  # dataclasses look their module up
    spec.loader.exec_module(ta)


def time_ms(fn, iters: int = 20) -> float:
    """Milliseconds per call, `iters` calls captured in one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (5 * iters)


def case(batch: int, context: int, fp8: bool):
    """(run, kv_bytes): one decode step's attention for `batch` sequences of `context` tokens."""
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    k = (torch.randn(num_blocks, BLOCK, HK, D, device="cuda") * 2).to(dt)
    v = (torch.randn(num_blocks, BLOCK, HK, D, device="cuda") * 2).to(dt)
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    scales = (torch.ones(1, device="cuda"), torch.ones(1, device="cuda")) if fp8 else (None, None)

    def run():
        ta.paged_attention_triton(q, k, v, tables, seq_lens, qsl, D ** -0.5, 0, *scales)

    return run, 2 * batch * context * HK * D * k.element_size()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", nargs="?", const="fp8", choices=("fp8", "all"),
                    help="also time other launch settings (for the FP8 cache, or for both)")
    ap.add_argument("--variant", default="f32", choices=sorted(VARIANTS))
    ap.add_argument("--shapes", default="1:2048,64:1024,256:192,1024:192,256:1024,1024:1024")
    args = ap.parse_args()
    load_variant(args.variant)
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    print(torch.cuda.get_device_name(), "Hq=32 Hk=8 D=128 block 16, FP8 tiles via", args.variant)
    picked = ta._launch_config
    for batch, context in shapes:
        for fp8 in (False, True):
            run, nbytes = case(batch, context, fp8)
            ms = time_ms(run)
            cfg = picked(batch, batch, HK, HQ // HK, D, 2, -(-context // BLOCK) * BLOCK,
                         torch.cuda.get_device_properties(0).multi_processor_count, True, 1 if fp8 else 2)
            print(f"batch {batch:5d} ctx {context:5d} {'fp8 ' if fp8 else 'bf16'}: {ms * 1000:8.1f} us "
                  f"{nbytes / ms / 1e9:6.2f} TB/s  ({cfg})", flush=True)
            if not args.sweep or (args.sweep == "fp8" and not fp8):
                continue
            results = []
            for block_n, stages, warps, split_mul in itertools.product((32, 64, 128), (2, 3), (1, 2, 4),
                                                                        (1, 2, 4)):
                def forced(*a, block_n=block_n, stages=stages, warps=warps, split_mul=split_mul, **kw):
                    base = picked(*a, **kw)
                    return replace(base, block_n=block_n, num_stages=stages, num_warps=warps,
                                   num_splits=min(base.num_splits * split_mul, 32))
                ta._launch_config = forced
                try:
                    ms = time_ms(run)
                    results.append((ms, block_n, stages, warps, split_mul))
                except Exception as e:  # an out-of-resources setting: skip it
                    print(f"   block_n {block_n} stages {stages} warps {warps}: {type(e).__name__}")
                finally:
                    ta._launch_config = picked
            results.sort()
            for ms, block_n, stages, warps, split_mul in results[:4]:
                print(f"   best: {ms * 1000:8.1f} us {nbytes / ms / 1e9:6.2f} TB/s block_n {block_n} "
                      f"stages {stages} warps {warps} splits x{split_mul}", flush=True)
            del run
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
