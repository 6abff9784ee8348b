"""Times kiln's lora_add kernel against the base linear it rides on (one CUDA GPU, inside CUDA graphs as the runtime
runs decode steps): the LoRA overhead per linear.

    python scripts/bench_lora_op.py   # bf16, rank 16, batch 1 and 64, 0/1/4 adapters in use; Llama-8B's o (K = N =
                                      # 4096) and fused qkv (4096 -> 4096 + 1024 + 1024): one call for all parts
                                      # (what the runtime runs) and, for comparison, one call per part (before)
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
    dev, dt, k, rank, slots = "cuda", torch.bfloat16, 4096, 16, 4
    print(f"{torch.cuda.get_device_name()}  K={k} rank={rank} {dt}")
    for name, parts in (("o", [4096]), ("qkv", [4096, 1024, 1024])):
        n, p = sum(parts), len(parts)
        ends = [sum(parts[:i + 1]) for i in range(p)]
        w = torch.randn(n, k, device=dev, dtype=dt) / 64
        a = torch.randn(slots, p * rank, k, device=dev, dtype=dt) / 64
        b = torch.randn(slots, n, rank, device=dev, dtype=dt) / 64
        scale = torch.ones(slots, device=dev, dtype=torch.float32)

        def per_part(y, x, slot, a=a, b=b, scale=scale, ends=ends):
            for i, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
                lora_add(y[:, start:end], x, a[:, i * rank:(i + 1) * rank], b[:, start:end], slot, scale)

        for t in (1, 64):
            x = torch.randn(t, k, device=dev, dtype=dt)
            y = torch.empty(t, n, device=dev, dtype=dt)
            base = time_ms(lambda x=x, y=y, w=w: torch.matmul(x, w.t(), out=y))
            line = [f"{name:3s} N={n} T={t:3d}: base GEMM {base * 1000:6.1f} us"]
            for used in (0, 1, 4):
                slot = (torch.arange(t, device=dev, dtype=torch.int32) % used) if used else \
                    torch.full((t,), -1, device=dev, dtype=torch.int32)
                cost = time_ms(lambda x=x, y=y, slot=slot, a=a, b=b, scale=scale, ends=ends:
                               lora_add(y, x, a, b, slot, scale, ends))
                cell = f"{used} adapter(s) {cost * 1000:5.1f} us ({cost / base:.0%})"
                if p > 1:
                    split = time_ms(lambda x=x, y=y, slot=slot, f=per_part: f(y, x, slot))
                    cell += f" [per part {split * 1000:5.1f} us]"
                line.append(cell)
            print(";  ".join(line))


if __name__ == "__main__":
    main()
