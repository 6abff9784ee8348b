"""Times kiln's lora_add kernel against the base linear it rides on (one CUDA GPU, inside CUDA graphs as the runtime
runs decode steps): the LoRA overhead per layer.

    python scripts/bench_lora_op.py            # K = N = 4096, rank 16, bf16, batch 1 and 64, 0/1/4 adapters
"""

from __future__ import annotations

import torch

from kiln.plugins.lora import lora_add


def time_ms(fn, iters: int = 50, graph: bool = True) -> float:
    """Milliseconds per call of `fn`; with `graph`, `iters` calls captured in one CUDA graph and replayed (as the
    runtime runs decode steps), so host launch costs do not count."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        run = g.replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        run() if graph else [fn() for _ in range(iters)]
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (10 * iters)


def main() -> None:
    dev, dt, k, n, rank, slots = "cuda", torch.bfloat16, 4096, 4096, 16, 4
    w = torch.randn(n, k, device=dev, dtype=dt) / 64
    a = torch.randn(slots, rank, k, device=dev, dtype=dt) / 64
    b = torch.randn(slots, n, rank, device=dev, dtype=dt) / 64
    scale = torch.ones(slots, device=dev, dtype=torch.float32)
    print(f"{torch.cuda.get_device_name()}  K={k} N={n} rank={rank} {dt}")
    for t in (1, 64):
        x = torch.randn(t, k, device=dev, dtype=dt)
        y = torch.empty(t, n, device=dev, dtype=dt)
        base = time_ms(lambda x=x, y=y: torch.matmul(x, w.t(), out=y))
        line = [f"T={t:3d}: base GEMM {base * 1000:7.1f} us"]
        for used in (0, 1, 4):
            slot = (torch.arange(t, device=dev, dtype=torch.int32) % used) if used else \
                torch.full((t,), -1, device=dev, dtype=torch.int32)
            cost = time_ms(lambda x=x, y=y, slot=slot: lora_add(y, x, a, b, slot, scale))
            line.append(f"lora_add {used} adapter(s) {cost * 1000:6.1f} us ({cost / base:.0%})")
        print(";  ".join(line))


if __name__ == "__main__":
    main()
