"""Times kiln's MXFP4 MoE kernels at GPT-OSS-20B's expert shapes (32 experts, hidden = intermediate = 2880, top 4,
biases, clamped SwiGLU; bfloat16) on one CUDA GPU: the "tiles" and "pairs" kernel sets of
plugins/triton_mxfp4_moe.py (pairs at each candidate tile) and, for scale, the float MoE kernel over the same
experts dequantized. Each row is checked against the dequantizing reference before it is timed.

    python scripts/bench_mxfp4_moe.py                       # tokens 1, 16, 256, 2048; every pairs candidate
    python scripts/bench_mxfp4_moe.py --tokens 1 --quick    # the default tile only

Times are milliseconds per whole MoE call (routing, both grouped GEMMs, the k-way sum), 20 calls in a CUDA graph
(kiln.builder.tune.graph_seconds), as the runtime's decode steps launch them. The last column is the share of
the H200's / H100's bandwidth the chosen experts' bytes would take at that time (4.25 bits a weight).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from kiln.builder.tune import graph_seconds
from kiln.plugins import fused_moe, triton_mxfp4_moe
from kiln.plugins.mxfp4 import dequantize_mxfp4
from kiln.plugins.mxfp4_moe import fused_moe_mxfp4, fused_moe_mxfp4_reference

EXPERTS, HIDDEN, INTER, TOP_K = 32, 2880, 2880, 4
CANDIDATES = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
              for n, k, w, s in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (2, 3))]


def random_mxfp4(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of a weight [E, rows, cols] of magnitude about 1 / sqrt(cols), on the GPU."""
    blocks = torch.randint(0, 256, (EXPERTS, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 121, (EXPERTS, rows, cols // 32), generator=gen).to(torch.uint8)
    return blocks.cuda(), scales.cuda()


def bytes_read(tokens: int) -> int:
    """MXFP4 bytes of the experts a batch of `tokens` reaches (uniform routing, expected distinct experts)."""
    reached = EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** tokens)
    per_expert = (2 * INTER * HIDDEN + HIDDEN * INTER) * 17 // 32  # 4 bits + one byte per 32 values
    return int(reached * per_expert)


def bench_tokens(tokens: int, weights: tuple, kw: dict, candidates: list[dict], bandwidth: float,
                 gen: torch.Generator) -> None:
    """Prints one row per kernel set (and pairs candidate) for a batch of `tokens`."""
    gate_up, down, w_gate_up, w_down = weights
    x = torch.randn(tokens, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, generator=gen).cuda()
    want = fused_moe_mxfp4_reference(x, logits, *gate_up, *down, TOP_K, True, kw["b_gate_up"], kw["b_down"],
                                     kw["swiglu_limit"], kw["swiglu_alpha"])
    ideal_ms = bytes_read(tokens) / (bandwidth * 1e12) * 1e3

    def row(name: str, fn) -> None:
        try:
            got = fn()
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=0.1)
            ms = graph_seconds(fn) * 1e3
        except Exception as exc:  # a candidate that does not compile or fit on this GPU is reported, not fatal
            print(f"{tokens:>6}  {name:<44} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:60]}")
            return
        print(f"{tokens:>6}  {name:<44} {ms:>8.3f}  {100 * ideal_ms / ms:>11.1f}%", flush=True)

    def mxfp4() -> torch.Tensor:
        return fused_moe_mxfp4(x, logits, *gate_up, *down, **kw)

    row("float kernel, dequantized experts", lambda: fused_moe(x, logits, w_gate_up, w_down, **kw))
    triton_mxfp4_moe.KERNELS = "tiles"
    row("tiles", mxfp4)
    triton_mxfp4_moe.KERNELS = "pairs"
    default = dict(triton_mxfp4_moe.PAIRS_LAUNCH)
    for cfg in candidates:
        triton_mxfp4_moe.PAIRS_LAUNCH = cfg
        row("pairs N{BLOCK_N} K{BLOCK_K} w{num_warps} s{num_stages}".format(**cfg), mxfp4)
    triton_mxfp4_moe.PAIRS_LAUNCH = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,16,256,2048", help="comma-separated token counts")
    parser.add_argument("--quick", action="store_true", help="time only the pairs kernels' default tile")
    parser.add_argument("--bandwidth", type=float, default=4.8, help="TB/s for the last column (H100 SXM: 3.35)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    gate_up, down = random_mxfp4(2 * INTER, HIDDEN, gen), random_mxfp4(HIDDEN, INTER, gen)
    b_gate_up = (0.1 * torch.randn(EXPERTS, 2 * INTER, generator=gen)).to("cuda", torch.bfloat16)
    b_down = (0.1 * torch.randn(EXPERTS, HIDDEN, generator=gen)).to("cuda", torch.bfloat16)
    kw = dict(top_k=TOP_K, renormalize=True, b_gate_up=b_gate_up, b_down=b_down, swiglu_limit=7.0,
              swiglu_alpha=1.702)
    w_gate_up, w_down = (dequantize_mxfp4(*t).to(torch.bfloat16) for t in (gate_up, down))
    default = dict(triton_mxfp4_moe.PAIRS_LAUNCH)
    candidates = [default] if args.quick else [default] + [c for c in CANDIDATES if c != default]
    print(f"{torch.cuda.get_device_name()}  E={EXPERTS} H={HIDDEN} I={INTER} top {TOP_K}, bfloat16; ms a MoE call")
    print(f"{'tokens':>6}  {'kernels':<44} {'ms':>8}  {'of bandwidth':>12}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        bench_tokens(tokens, (gate_up, down, w_gate_up, w_down), kw, candidates, args.bandwidth, gen)


if __name__ == "__main__":
    main()
