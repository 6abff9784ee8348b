"""Times the FP8 W8A8 GEMM at large batches (prefill chunks, batch-1024 decode) on one CUDA GPU, Llama-3.1-8B's
four shapes, every way kiln could run it: what a throughput step spends most of its time in (57% of an FP8
128 / 128 run's GPU time on an H200, at 64% of the FP8 peak).

    python scripts/bench_fp8_gemm.py                        # M = 256, 1024, 2048, 4096, 8192
    python scripts/bench_fp8_gemm.py --m 1024 --shapes gate_up

Rows: kiln's path today (torch._scaled_mm with row-wise scales, exact float32 promotion: use_fast_accum=False);
the same with fast accumulation (what vLLM's CUTLASS and TensorRT-LLM's FP8 GEMMs use on Hopper); one scale
per tensor (the cuBLASLt path; kiln's fused layers keep a scale per part, so this needs parts requantized to
one scale at build); kiln's Triton _scaled_mm_kernel at its heuristic tile and at larger ones. Each row gives
milliseconds (20 launches in a CUDA graph, kiln.builder.tune.graph_seconds), TFLOP/s, and its largest error
against a float32 product of the same FP8 operands, relative to that product's largest magnitude (what fast
accumulation costs over K = 14,336 shows here).
"""

from __future__ import annotations

import argparse

import torch

from kiln.builder.tune import graph_seconds
from kiln.plugins.triton_scaled_linear import GemmConfig, _launch, gemm_config

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
TRITON_TILES = [GemmConfig(128, 256, 8, 3), GemmConfig(256, 128, 8, 3), GemmConfig(128, 128, 4, 4),
                GemmConfig(64, 256, 4, 4), GemmConfig(128, 128, 8, 4)]


def variants(x_q, s_x, w, w_scale, sms: int) -> dict:
    """name -> a call computing [M, N] bfloat16 from the FP8 operands (x_q [M, K], w [N, K], s_x [M, 1],
    w_scale [N])."""
    m, n = x_q.shape[0], w.shape[0]
    row_b = w_scale.view(1, n)
    one_a, one_b = s_x[:1, 0].reshape(()).contiguous(), w_scale[:1].reshape(()).contiguous()
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x_q.device)

    def scaled_mm(scale_a, scale_b, fast):
        return lambda: torch._scaled_mm(x_q, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)

    calls = {"rowwise (kiln today)": scaled_mm(s_x, row_b, False),
             "rowwise, fast accumulation": scaled_mm(s_x, row_b, True),
             "per-tensor scales": scaled_mm(one_a, one_b, False),
             "per-tensor scales, fast accumulation": scaled_mm(one_a, one_b, True)}
    heuristic = gemm_config(m, n, sms, x_q.shape[1])
    for cfg in [heuristic] + [c for c in TRITON_TILES if c != heuristic]:
        name = f"triton {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
        calls[name + (" (heuristic)" if cfg == heuristic else "")] = (
            lambda cfg=cfg: _launch(out, x_q, s_x, w, w_scale, None, out, cfg))
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="256,1024,2048,4096,8192", help="comma-separated token counts")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    args = parser.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  FP8 e4m3 x FP8 e4m3 -> bfloat16, scales per token and per row")
    print(f"{'shape':<8} {'M':>5}  {'way':<44} {'ms':>8} {'TFLOP/s':>8} {'max rel err':>11}")
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.5).to(torch.float8_e4m3fn)
        w_scale = torch.rand(n, device=dev, generator=gen) * 1e-3 + 1e-3  # [N] float32
        for m in (int(v) for v in args.m.split(",")):
            x_q = torch.randn(m, k, device=dev, generator=gen).to(torch.float8_e4m3fn)
            s_x = torch.rand(m, 1, device=dev, generator=gen) * 1e-2 + 1e-2  # [M, 1] float32
            exact = (x_q.float() @ w.float().t()) * s_x * w_scale  # [M, N] float32
            scale = exact.abs().max().item()
            flops = 2 * m * n * k
            for name, call in variants(x_q, s_x, w, w_scale, sms).items():
                try:
                    got = call().float()
                    if name.startswith("per-tensor"):  # one scale each: compare against that product
                        want = (x_q.float() @ w.float().t()) * s_x[0, 0] * w_scale[0]
                        err = (got - want).abs().max().item() / want.abs().max().item()
                    else:
                        err = (got - exact).abs().max().item() / scale
                    ms = graph_seconds(call) * 1e3
                except Exception as exc:  # a tile that does not fit this GPU's shared memory is reported
                    print(f"{shape:<8} {m:>5}  {name:<44} failed: {type(exc).__name__}: {str(exc)[:60]}")
                    continue
                print(f"{shape:<8} {m:>5}  {name:<44} {ms:>8.3f} {flops / ms / 1e9:>8.0f} {err:>11.2e}", flush=True)


if __name__ == "__main__":
    main()
