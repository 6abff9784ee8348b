"""The Triton W8A8 kernels (kiln::scaled_linear, FP8 / INT8; kiln::fp8_block_linear) against the PyTorch
references: on the CPU through Triton's interpreter (tiny shapes), and on CUDA (Llama-8B shapes, bfloat16).

What must match, and how closely:
- the quantized activations and their scales: byte for byte (same IEEE division, saturation and rounding);
- INT8 outputs: bit for bit (exact int32 sums on both sides; the epilogue rounds in the reference's order);
- FP8 outputs: products of e4m3 values are exact in float32, so only the float32 summation order differs
  (and, on Hopper, the tensor cores' short accumulator within one K step of 128): see assert_sum_order_close.

The helpers below serve both the CUDA tests and the interpreted ones, which import this file in a fresh
process with TRITON_INTERPRET=1 (tests/triton_interpret.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cuda_graph_capture import capture
from triton_interpret import needs_triton, run_interpreted

from kiln.plugins import fp8_block_linear, scaled_linear
from kiln.plugins._triton import USE_TRITON
from kiln.plugins.fp8_block_linear import fp8_block_linear_reference, quantize_activation_groups
from kiln.plugins.kv_cache import quantize_kv
from kiln.plugins.quant_linear import FP8_MAX, INT8_MAX, MIN_DYNAMIC_SCALE, scaled_linear_reference

FP8, INT8 = torch.float8_e4m3fn, torch.int8
QMAX = {FP8: FP8_MAX, INT8: INT8_MAX}
FLOAT32_UNIT = 2.0 ** -24  # float32's unit roundoff
# Hopper's FP8 MMA keeps about 14 bits of its running sum (DeepSeek-V3, §3.3.2), and the kernels move it to
# float32 every 128 columns: 4 MMAs of 32, each losing at most ~2^-13 of the magnitudes it adds.
HOPPER_FP8_ACCUMULATION = 2.0 ** -11


# --- shared helpers ---


def random_weight(n: int, k: int, qdtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """[N, K] int8 over the full range, or float8_e4m3fn spread over most exponents (with saturated ones)."""
    if qdtype == INT8:
        return torch.randint(-128, 128, (n, k), generator=gen, dtype=INT8)
    return (torch.randn(n, k, generator=gen) * 96).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def reference_activations(x: torch.Tensor, qdtype: torch.dtype, input_scale: torch.Tensor | None,
                          pre_quant_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled_linear_reference's quantization of x, step by step: x: [T, K] -> (x_q [T, K], s_x [T])."""
    xs = x.float() if pre_quant_scale is None else x.float() * pre_quant_scale
    if input_scale is None:
        amax = xs.abs().amax(dim=-1, keepdim=True)  # [T, 1]
        s_x = (amax / torch.full((), QMAX[qdtype], device=x.device)).clamp(min=MIN_DYNAMIC_SCALE)
    else:
        s_x = input_scale.expand(x.shape[0], 1)
    return quantize_kv(xs, s_x, qdtype), s_x[:, 0]  # the same x / s_x, saturation and rounding


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = (got.view(torch.uint8) != want.view(torch.uint8)).sum().item()
    assert bad == 0, f"{what}: {bad} of {got.numel()} bytes differ"


def assert_sum_order_close(out: torch.Tensor, ref: torch.Tensor, abs_sum: torch.Tensor, sum_error: float,
                           what: str) -> None:
    """out, ref: [T, N] in x's dtype; abs_sum: [T, N], the sum of |x_q * w * scales| over each output's K
    terms. Two float32 sums of the same exact terms in different orders differ by at most about
    2 K u * abs_sum (u = 2^-24; passed in as sum_error, with any accumulator loss on top); the final rounding
    to the output dtype then adds at most an ulp of the output (<= eps * |value|) on each side."""
    eps = torch.finfo(out.dtype).eps
    err = (out.double() - ref.double()).abs()
    allowed = 2 * eps * ref.double().abs() + sum_error * abs_sum.double()
    excess = err - allowed
    worst = excess.argmax()
    assert (excess <= 0).all(), (f"{what}: {(excess > 0).sum().item()} of {out.numel()} outputs off; at the "
                                 f"worst, error {err.flatten()[worst]:.3g} > allowed {allowed.flatten()[worst]:.3g}")


def check_scaled_linear(x, weight, weight_scale, input_scale, bias, pre_quant_scale, sum_error, what):
    """The kernel's quantized activations, scales and output against the reference's."""
    from kiln.plugins.triton_scaled_linear import quantize_activations_triton, scaled_linear_triton

    t, k = x.shape
    x_q, s_x = quantize_activations_triton(x, weight.dtype, k, input_scale, pre_quant_scale)
    want_q, want_s = reference_activations(x, weight.dtype, input_scale, pre_quant_scale)
    assert_same_bytes(x_q, want_q, f"{what}: x_q")
    assert torch.equal(s_x, want_s[:, None]), f"{what}: s_x"
    out = scaled_linear_triton(x, weight, weight_scale, input_scale, bias, pre_quant_scale)
    ref = scaled_linear_reference(x, weight, weight_scale, input_scale, bias, pre_quant_scale)
    assert out.dtype == x.dtype and out.shape == ref.shape
    if weight.dtype == INT8:
        assert torch.equal(out, ref), f"{what}: {(out != ref).sum().item()} of {out.numel()} outputs differ"
        return
    abs_sum = (want_q.float().abs() @ weight.float().abs().t()) * want_s[:, None] * weight_scale[None, :]
    assert_sum_order_close(out, ref, abs_sum, sum_error, what)


def check_fp8_block_linear(x, weight, weight_scale_inv, block_size, bias, sum_error, what):
    from kiln.plugins.triton_fp8_block_linear import fp8_block_linear_triton
    from kiln.plugins.triton_scaled_linear import quantize_activations_triton

    (t, k), n = x.shape, weight.shape[0]
    b0, b1 = block_size
    x_q, s_x = quantize_activations_triton(x, FP8, b1)  # [T, G * b1], [T, G]
    want_q, want_s = quantize_activation_groups(x, b1)  # [T, G, b1], [T, G]
    assert_same_bytes(x_q, want_q.view(t, -1), f"{what}: x_q")
    assert torch.equal(s_x, want_s), f"{what}: s_x"
    out = fp8_block_linear_triton(x, weight, weight_scale_inv, block_size, bias)
    ref = fp8_block_linear_reference(x, weight, weight_scale_inv, block_size, bias)
    assert out.dtype == x.dtype and out.shape == ref.shape
    x_real = (want_q.float() * want_s[:, :, None]).view(t, -1)[:, :k]  # [T, K]
    w_real = weight.float() * weight_scale_inv.repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :k]
    assert_sum_order_close(out, ref, x_real.abs() @ w_real.abs().t(), sum_error, what)


# --- CPU: the kernels under Triton's interpreter ---


def interpreted_scaled_linear_checks() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 40
    # K: under one 128-column step, ragged over two, two exact ones. float16 and float32 activations: the
    # interpreter rounds float32 to bfloat16 by truncation (the GPU rounds to nearest), so bfloat16 is checked
    # on CUDA only.
    cases = [(k, t, dtype) for k, dtype in ((64, torch.float16), (200, torch.float32), (256, torch.float16))
             for t in (1, 5, 33)]
    for i, (k, t, dtype) in enumerate(cases):
        x = (torch.randn(t, k, generator=gen) * 4).to(dtype)
        if t > 1:
            x[1] = 0  # a dynamic scale floors at MIN_DYNAMIC_SCALE and gives zeros
        for qdtype in (FP8, INT8):
            weight = random_weight(n, k, qdtype, gen)
            weight_scale = torch.rand(n, generator=gen) * 1e-3 + 1e-4
            pqs = torch.rand(k, generator=gen) + 0.5 if i % 2 else None
            bias = torch.randn(n, generator=gen).to(dtype) if i % 3 else None
            # 0.9 of the largest |x| / qmax: the largest values saturate.
            static = (0.9 * x.float().abs().amax() / QMAX[qdtype]).reshape(1)
            for input_scale in (None, static):
                what = f"{qdtype} K={k} T={t} {dtype} static={input_scale is not None}"
                check_scaled_linear(x, weight, weight_scale, input_scale, bias, pqs, 4 * k * FLOAT32_UNIT,
                                    what)
    # Decode launches with K split into ranges (as tuned settings or the heuristic ask): raw int32 / float32
    # sums per range, added in order by the second kernel, then the same epilogue (INT8 stays bit for bit).
    # K = 600: 5 steps of 128, the last one ragged; 4 splits of 2 steps become 3.
    from kiln.plugins import tuning
    from kiln.plugins.triton_scaled_linear import TUNED_KERNEL, tuning_key

    k = 600
    for t, split in ((1, 2), (5, 4)):
        x = (torch.randn(t, k, generator=gen) * 4).to(torch.float16)
        for qdtype in (FP8, INT8):
            weight = random_weight(n, k, qdtype, gen)
            weight_scale = torch.rand(n, generator=gen) * 1e-3 + 1e-4
            bias = torch.randn(n, generator=gen).to(torch.float16) if t > 1 else None
            tuning.install({TUNED_KERNEL: {tuning_key(t, n, k, qdtype == INT8): {
                "block_n": 32, "split_k": split, "num_warps": 4, "num_stages": 2}}})
            check_scaled_linear(x, weight, weight_scale, None, bias, None, 4 * k * FLOAT32_UNIT,
                                f"{qdtype} K={k} T={t} split={split}")
            tuning.clear()


def interpreted_rounding_checks() -> None:
    """Every float8 value, the midpoints between neighbours (ties, half to even) and their float32 neighbours,
    values past the range, +-0; scaled by 1/4 for int8, which puts ties at n + 0.5. Static scale 1."""
    from kiln.plugins.triton_scaled_linear import quantize_activations_triton

    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    grid = grid[~grid.isnan()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                   torch.tensor([449.0, 464.0, 470.0, 1e30, -464.0, -1e30, -0.0])])
    x = torch.nn.functional.pad(x, (0, -x.numel() % 64)).view(-1, 64)  # [T, 64]
    one = torch.ones(1)
    for qdtype, values in ((FP8, x), (INT8, x / 4)):
        x_q, _ = quantize_activations_triton(values, qdtype, 64, one)
        assert_same_bytes(x_q, reference_activations(values, qdtype, one, None)[0], f"{qdtype} rounding")


def interpreted_fp8_block_checks() -> None:
    gen = torch.Generator().manual_seed(1)
    # (T, N, K, block): K = 200 ends in a partial group, N = 40 in a partial row block; [128, 64] puts one
    # weight-scale row over several tiles' columns; [16, 96] has groups narrower than the 128-wide K step.
    for t, n, k, block in ((1, 40, 256, [128, 128]), (5, 40, 200, [128, 128]), (33, 72, 200, [16, 96]),
                           (5, 40, 256, [128, 64])):
        dtype = torch.float16 if t % 2 else torch.float32
        x = (torch.randn(t, k, generator=gen) * 4).to(dtype)
        if t > 1:
            x[1, : block[1]] = 0  # an all-zero group: floored scale, zeros
        weight = random_weight(n, k, FP8, gen)
        scale_inv = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 1e-3 + 1e-4
        bias = torch.randn(n, generator=gen).to(dtype) if t > 1 else None
        check_fp8_block_linear(x, weight, scale_inv, block, bias, 4 * k * FLOAT32_UNIT,
                               f"T={t} N={n} K={k} block={block} {dtype}")


_RUN = """
import sys
sys.path.insert(0, {tests!r})
import test_kernels_scaled_linear as checks
checks.{name}()
print("ok")
"""


def _run_interpreted(name: str) -> None:
    out = run_interpreted(_RUN.format(tests=str(Path(__file__).parent), name=name))
    assert out.strip().endswith("ok")


@needs_triton
def test_interpreted_scaled_linear_matches_the_reference():
    _run_interpreted("interpreted_scaled_linear_checks")


@needs_triton
def test_interpreted_activation_rounding_matches_the_reference():
    _run_interpreted("interpreted_rounding_checks")


@needs_triton
def test_interpreted_fp8_block_linear_matches_the_reference():
    _run_interpreted("interpreted_fp8_block_checks")


@needs_triton
def test_gemm_tiles_suit_small_batches():
    from kiln.plugins.triton_scaled_linear import gemm_config

    # Decode: 16-token tiles; 64 columns would leave a third of 132 SMs idle at N = 6144, so 32; given K, K
    # splits until the SMs have about 4 tiles each (at most 8 ranges of at least 4 steps).
    assert (gemm_config(1, 6144, 132).block_m, gemm_config(1, 6144, 132).block_n) == (16, 32)
    assert gemm_config(1, 6144, 132).split_k == 1
    assert gemm_config(1, 6144, 132, k=4096).split_k == 3
    assert gemm_config(1, 4096, 132, k=4096).split_k == 5
    assert gemm_config(1, 4096, 132, k=256).split_k == 1
    assert gemm_config(16, 28672, 132, k=4096).split_k == 2
    assert gemm_config(64, 4096, 132, k=4096).split_k == 1
    assert (gemm_config(16, 14336, 132).block_m, gemm_config(16, 14336, 132).block_n) == (16, 64)
    assert (gemm_config(256, 6144, 132).block_m, gemm_config(256, 6144, 132).block_n) == (128, 128)


# --- CUDA ---

needs_cuda_kernels = pytest.mark.skipif(not (torch.cuda.is_available() and USE_TRITON),
                                        reason="needs CUDA and triton (with KILN_DISABLE_TRITON unset)")
LLAMA_K = 4096  # Llama-3.1-8B's hidden size; N: 6144 = fused qkv, 14336 = the MLP's intermediate size
# float32 sums over K in two orders, plus Hopper's FP8 accumulator within each 128-column step.
GPU_FP8_SUM_ERROR = 4 * LLAMA_K * FLOAT32_UNIT + HOPPER_FP8_ACCUMULATION
# cuBLASLt's fast accumulation (FP8_FAST_ACCUM) keeps the whole sum in that accumulator: each of its K / 32 MMAs
# may lose ~2^-14 of the magnitudes summed so far.
CUBLASLT_SUM_ERROR = GPU_FP8_SUM_ERROR + LLAMA_K / 32 * 2.0 ** -14


def _cuda_case(t, n, k, seed, qdtype=FP8):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, k, generator=gen) * 2).to("cuda", torch.bfloat16)
    x[0, :: k // 8] *= 40  # outliers, as real activations have
    weight = random_weight(n, k, qdtype, gen).cuda()
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16)
    return gen, x, weight, bias


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("qdtype, static", [(FP8, False), (FP8, True), (INT8, False), (INT8, True)],
                         ids=["fp8-dynamic", "fp8-static", "int8-dynamic", "int8-static"])
@pytest.mark.parametrize("n", [6144, 14336])
@pytest.mark.parametrize("t", [1, 16, 256])
def test_scaled_linear_matches_reference_at_llama_shapes(t, n, qdtype, static):
    gen, x, weight, bias = _cuda_case(t, n, LLAMA_K, seed=t + n, qdtype=qdtype)
    weight_scale = (torch.rand(n, generator=gen) * 1e-3 + 1e-4).cuda()
    input_scale = (0.5 * x.float().abs().amax() / QMAX[qdtype]).reshape(1) if static else None
    # SmoothQuant-style smoothing with INT8, a bias with FP8: each path sees its usual inputs.
    pqs = (torch.rand(LLAMA_K, generator=gen) + 0.5).cuda() if qdtype == INT8 else None
    check_scaled_linear(x, weight, weight_scale, input_scale, None if qdtype == INT8 else bias, pqs,
                        GPU_FP8_SUM_ERROR, f"{qdtype} T={t} N={n} static={static}")


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("t", [17, 256, 1024])
def test_fp8_scaled_linear_through_cublaslt_matches_reference(t, static):
    """From CUBLASLT_MIN_TOKENS tokens, bfloat16 without bias: torch._scaled_mm with row-wise scales."""
    from kiln.plugins.triton_scaled_linear import _takes_cublaslt

    gen, x, weight, _ = _cuda_case(t, 6144, LLAMA_K, seed=t)
    assert _takes_cublaslt(x, weight, None)
    weight_scale = (torch.rand(6144, generator=gen) * 1e-3 + 1e-4).cuda()
    input_scale = (0.5 * x.float().abs().amax() / QMAX[FP8]).reshape(1) if static else None
    check_scaled_linear(x, weight, weight_scale, input_scale, None, None, CUBLASLT_SUM_ERROR,
                        f"cuBLASLt T={t} static={static}")


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("t, n, k", [(1, 6144, LLAMA_K), (16, 14336, LLAMA_K), (256, 6144, LLAMA_K),
                                     (256, 14336, LLAMA_K), (37, 1000, 4000)])
def test_fp8_block_linear_matches_reference(t, n, k):
    gen, x, weight, bias = _cuda_case(t, n, k, seed=t + n + k)
    scale_inv = (torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 1e-3 + 1e-4).cuda()
    check_fp8_block_linear(x, weight, scale_inv, [128, 128], bias if t != 16 else None,
                           4 * k * FLOAT32_UNIT + HOPPER_FP8_ACCUMULATION, f"T={t} N={n} K={k}")


@pytest.mark.gpu
@needs_cuda_kernels
def test_w8a8_ops_run_the_kernels_inside_a_cuda_graph():
    """The ops dispatch to the kernels, which read every scale on the GPU: a decode step's W8A8 linears
    capture in one CUDA graph, and a replay on new activations gives the launchers' results."""
    from kiln.plugins.triton_fp8_block_linear import fp8_block_linear_triton
    from kiln.plugins.triton_scaled_linear import scaled_linear_triton

    for op in ("scaled_linear", "fp8_block_linear"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kiln::{op}", "CUDA"), op
    t, n, k = 8, 6144, LLAMA_K
    gen, x, fp8_weight, bias = _cuda_case(t, n, k, seed=5)
    int8_weight = random_weight(n, k, INT8, gen).cuda()
    weight_scale = (torch.rand(n, generator=gen) * 1e-3).cuda()
    input_scale = torch.tensor([0.05], device="cuda")
    pqs = (torch.rand(k, generator=gen) + 0.5).cuda()
    block_scale = (torch.rand(n // 128, k // 128, generator=gen) * 1e-3).cuda()
    calls = [
        (scaled_linear, scaled_linear_triton, (fp8_weight, weight_scale, None, bias, None)),
        (scaled_linear, scaled_linear_triton, (int8_weight, weight_scale, input_scale, None, pqs)),
        (fp8_block_linear, fp8_block_linear_triton, (fp8_weight, block_scale, [128, 128], bias)),
    ]

    def step():
        return [op(x, *args) for op, _, args in calls]

    graph, outs = capture(step)
    x.copy_(torch.randn(t, k, generator=gen).to("cuda", torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    for out, (_, kernel, args) in zip(outs, calls):
        assert torch.equal(out, kernel(x, *args))


@pytest.mark.gpu
@needs_cuda_kernels
def test_fp8_cublaslt_path_replays_in_a_cuda_graph():
    """A prefill-sized FP8 linear (torch._scaled_mm) captures too: its scales are device tensors."""
    from kiln.plugins.triton_scaled_linear import scaled_linear_triton

    t, n, k = 64, 6144, LLAMA_K
    gen, x, weight, _ = _cuda_case(t, n, k, seed=7)
    weight_scale = (torch.rand(n, generator=gen) * 1e-3).cuda()
    graph, out = capture(lambda: scaled_linear(x, weight, weight_scale))
    x.copy_(torch.randn(t, k, generator=gen).to("cuda", torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, scaled_linear_triton(x, weight, weight_scale, None, None, None))
