"""The fused norm / activation + FP8 quantization operators (plugins/norm_quant.py) and the GEMM that takes
their output (quant_linear.scaled_linear_quantized).

What must hold:
- CPU: each reference is the float operator's reference followed by scaled_linear's quantization, byte for
  byte and scale for scale; scaled_linear_quantized on their output is scaled_linear on the float output.
- Triton's interpreter: the kernels give the references' bytes and scales. The norm inputs are multiples of
  1/8 up to 4 in magnitude, whose squares sum exactly in float32 in any order, so the check is of the
  kernels' rounding steps and not of the reduction order (the GPU checks realistic inputs too).
- CUDA (gpu marker): the same at Llama-8B widths in bfloat16; scaled_linear_quantized takes scaled_linear's
  GEMM path (Triton kernel or cuBLASLt) and gives its outputs bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from triton_interpret import needs_triton, run_interpreted

from kiln.plugins import (
    fused_add_rms_norm,
    fused_add_rms_norm_quant,
    rms_norm,
    rms_norm_quant,
    scaled_linear,
    scaled_linear_quantized,
    silu_and_mul,
    silu_and_mul_quant,
)
from kiln.plugins._triton import USE_TRITON
from kiln.plugins.activation import silu_and_mul_reference
from kiln.plugins.norm import fused_add_rms_norm_reference, rms_norm_reference
from kiln.plugins.norm_quant import (
    fused_add_rms_norm_quant_reference,
    rms_norm_quant_reference,
    silu_and_mul_quant_reference,
)
from kiln.plugins.quant_linear import FP8_MAX

FP8 = torch.float8_e4m3fn
EPS = 1e-5


# --- shared helpers (the interpreted and CUDA checks import this file too) ---


def exact_norm_input(t: int, h: int, gen: torch.Generator, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """[T, H] multiples of 1/8 in [-4, 4]: their squares, and those of two such values' sum, are multiples of
    1/64 up to 64, which float32 sums exactly in any order while H <= 4096 (24 bits: 2^12 * 2^6 by 2^-6)."""
    return (torch.randint(-32, 33, (t, h), generator=gen) / 8).to(device, dtype)


def static_scale(y: torch.Tensor) -> torch.Tensor:
    """[1] float32 below the largest |y| / 448, so the largest values saturate."""
    return (0.7 * y.float().abs().amax() / FP8_MAX).reshape(1).clamp(min=1e-6)


def quantize_as_scaled_linear(y: torch.Tensor, input_scale: torch.Tensor | None):
    """scaled_linear_reference's FP8 quantization of y ([T, D]), spelled out by test_kernels_scaled_linear:
    -> (x_q [T, D], x_scale [T, 1])."""
    from test_kernels_scaled_linear import reference_activations

    x_q, s_x = reference_activations(y, FP8, input_scale, None)
    return x_q, s_x[:, None]


def assert_same_quantized(got, want, what: str) -> None:
    """(x_q, x_scale, ...) pairs: FP8 bytes equal, scales and further outputs equal (and shaped alike)."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what} [{i}]: {g.shape} {g.dtype} != {w.shape} {w.dtype}"
        if g.dtype == FP8:
            bad = (g.view(torch.uint8) != w.view(torch.uint8)).sum().item()
        else:
            bad = (g != w).sum().item()
        assert bad == 0, f"{what} [{i}]: {bad} of {g.numel()} differ"


def compositions(x, residual, weight, gate_up, mode: str):
    """{op: (input_scale, the fused reference's outputs, the float reference's then the quantization)}; a
    static scale is taken from each op's float output (static_scale), None in dynamic mode."""
    normed = rms_norm_reference(x, weight, EPS)
    added, summed = fused_add_rms_norm_reference(x, residual, weight, EPS)
    act = silu_and_mul_reference(gate_up)
    s_norm, s_add, s_act = ((static_scale(y) if mode == "static" else None) for y in (normed, added, act))
    return {
        "rms_norm_quant": (s_norm, rms_norm_quant_reference(x, weight, EPS, s_norm),
                           quantize_as_scaled_linear(normed, s_norm)),
        "fused_add_rms_norm_quant": (s_add, fused_add_rms_norm_quant_reference(x, residual, weight, EPS, s_add),
                                     (*quantize_as_scaled_linear(added, s_add), summed)),
        "silu_and_mul_quant": (s_act, silu_and_mul_quant_reference(gate_up, s_act),
                               quantize_as_scaled_linear(act, s_act)),
    }


def kernel_outputs(x, residual, weight, gate_up, refs) -> dict:
    """{op: the Triton kernel's outputs} with the input scales of compositions' `refs`."""
    from kiln.plugins.triton_norm_quant import (
        fused_add_rms_norm_quant_triton,
        rms_norm_quant_triton,
        silu_and_mul_quant_triton,
    )

    return {
        "rms_norm_quant": rms_norm_quant_triton(x, weight, EPS, refs["rms_norm_quant"][0]),
        "fused_add_rms_norm_quant": fused_add_rms_norm_quant_triton(x, residual, weight, EPS,
                                                                    refs["fused_add_rms_norm_quant"][0]),
        "silu_and_mul_quant": silu_and_mul_quant_triton(gate_up, refs["silu_and_mul_quant"][0]),
    }


def random_fp8_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float8_e4m3fn over most exponents and [N] float32 per-row scales."""
    weight = (torch.randn(n, k, generator=gen) * 96).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return weight, torch.rand(n, generator=gen) * 1e-3 + 1e-4


# --- CPU: the references ---


@pytest.mark.parametrize("mode", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 3, 64])
def test_references_are_the_float_reference_then_scaled_linears_quantization(t, dtype, mode):
    gen = torch.Generator().manual_seed(t)
    h, inter = 256, 192
    x = (torch.randn(t, h, generator=gen) * 3).to(dtype)
    residual = torch.randn(t, h, generator=gen).to(dtype)
    weight = torch.randn(h, generator=gen).to(dtype)
    gate_up = (torch.randn(t, 2 * inter, generator=gen) * 4).to(dtype)
    if t > 1:  # an all-zero row: the dynamic scale floors at MIN_DYNAMIC_SCALE, the values quantize to zeros
        x[1], residual[1], gate_up[1] = 0, 0, 0
    for op, (_, got, want) in compositions(x, residual, weight, gate_up, mode).items():
        assert_same_quantized(got, want, f"{op} T={t} {dtype} {mode}")


def test_wrappers_run_the_references_on_the_cpu():
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 64, generator=gen).bfloat16(), torch.randn(5, 64, generator=gen).bfloat16()
    weight, gate_up = torch.randn(64, generator=gen).bfloat16(), torch.randn(5, 96, generator=gen).bfloat16()
    scale = torch.tensor([0.01])
    for input_scale in (None, scale):
        assert_same_quantized(rms_norm_quant(x, weight, 1, input_scale),  # an int eps, as callers may pass
                              rms_norm_quant_reference(x, weight, 1.0, input_scale), "rms_norm_quant")
        assert_same_quantized(fused_add_rms_norm_quant(x, residual, weight, EPS, input_scale),
                              fused_add_rms_norm_quant_reference(x, residual, weight, EPS, input_scale),
                              "fused_add_rms_norm_quant")
        assert_same_quantized(silu_and_mul_quant(gate_up, input_scale),
                              silu_and_mul_quant_reference(gate_up, input_scale), "silu_and_mul_quant")
    x_scale = rms_norm_quant(x, weight, EPS, scale)[1]
    assert x_scale.shape == (5, 1) and (x_scale == scale).all()
    assert x_scale.data_ptr() != scale.data_ptr()  # an op's output is never its input


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("mode", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_linear_quantized_on_the_fused_output_is_scaled_linear_on_the_float_output(dtype, mode, bias):
    gen = torch.Generator().manual_seed(3)
    t, h, inter, n = 7, 128, 96, 48
    x, residual = (torch.randn(t, h, generator=gen) * 3).to(dtype), torch.randn(t, h, generator=gen).to(dtype)
    norm_weight = torch.randn(h, generator=gen).to(dtype)
    gate_up = (torch.randn(t, 2 * inter, generator=gen) * 4).to(dtype)
    input_scale = torch.tensor([0.004]) if mode == "static" else None
    cases = [  # (the float output, the fused op's x_q and x_scale)
        (rms_norm(x, norm_weight, EPS), rms_norm_quant(x, norm_weight, EPS, input_scale)),
        (fused_add_rms_norm(x, residual, norm_weight, EPS)[0],
         fused_add_rms_norm_quant(x, residual, norm_weight, EPS, input_scale)[:2]),
        (silu_and_mul(gate_up), silu_and_mul_quant(gate_up, input_scale)),
    ]
    for y, (x_q, x_scale) in cases:
        weight, weight_scale = random_fp8_weight(n, y.shape[1], gen)
        b = torch.randn(n, generator=gen).to(dtype) if bias else None
        want = scaled_linear(y, weight, weight_scale, input_scale, b)
        got = scaled_linear_quantized(x_q, x_scale, weight, weight_scale, b, out_dtype=dtype)
        assert got.dtype == dtype and torch.equal(got, want)
        if input_scale is not None:  # one scale for all rows, as [1], gives the same
            assert torch.equal(scaled_linear_quantized(x_q, input_scale, weight, weight_scale, b, out_dtype=dtype),
                               want)


def test_ops_pass_torch_library_opcheck():
    x, weight, scale = torch.randn(3, 8), torch.ones(8), torch.tensor([0.01])
    w8 = torch.randn(4, 8).to(FP8)
    cases = [(torch.ops.kiln.rms_norm_quant.default, (x, weight, 1e-6, s)) for s in (None, scale)]
    cases += [(torch.ops.kiln.fused_add_rms_norm_quant.default, (x, x.clone(), weight, 1e-6, s)) for s in (None, scale)]
    cases += [(torch.ops.kiln.silu_and_mul_quant.default, (x, s)) for s in (None, scale)]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    # test_schema's check that inputs are left alone compares them with ops torch lacks for float8 on the CPU.
    x_q, x_scale = rms_norm_quant(x, weight, 1e-6)
    for b in (None, torch.ones(4)):
        torch.library.opcheck(torch.ops.kiln.scaled_linear_quantized.default,
                              (x_q, x_scale, w8, torch.ones(4), b, torch.float32), test_utils=("test_faketensor",))


def _fp8(*shape):
    return torch.zeros(*shape, dtype=FP8)


@pytest.mark.parametrize("call, message", [
    (lambda: rms_norm_quant(torch.randn(8), torch.ones(8), EPS), "x must have 2 dims"),
    (lambda: rms_norm_quant(torch.randn(2, 8).half(), torch.ones(8), EPS), "weight has dtype"),
    (lambda: rms_norm_quant(torch.randn(2, 8), torch.ones(4), EPS), r"weight.shape\[0\] is 4, expected 8"),
    (lambda: rms_norm_quant(torch.randn(2, 8).int(), torch.ones(8), EPS), "x has dtype"),
    (lambda: rms_norm_quant(torch.randn(8, 2).t(), torch.ones(8), EPS), "x must be contiguous"),
    (lambda: rms_norm_quant(torch.randn(2, 0), torch.ones(0), EPS), "x has no features"),
    (lambda: rms_norm_quant(torch.randn(2, 8), torch.ones(8), EPS, torch.ones(2)),
     r"input_scale.shape\[0\] is 2, expected 1"),
    (lambda: rms_norm_quant(torch.randn(2, 8), torch.ones(8), EPS, torch.ones(1).double()), "input_scale has dtype"),
    (lambda: fused_add_rms_norm_quant(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), EPS),
     "residual must match x"),
    (lambda: fused_add_rms_norm_quant(torch.randn(2, 8), torch.randn(8, 2).t(), torch.ones(8), EPS),
     "residual must be contiguous"),
    (lambda: silu_and_mul_quant(torch.randn(2, 7)), "must be even"),
    (lambda: silu_and_mul_quant(torch.randn(2, 8), torch.ones(1, 1)), "input_scale must have 1 dims"),
    (lambda: scaled_linear_quantized(torch.randn(2, 8), torch.ones(2, 1), _fp8(4, 8), torch.ones(4),
                                     out_dtype=torch.bfloat16), "x_q has dtype"),
    (lambda: scaled_linear_quantized(_fp8(2, 8), torch.ones(2, 1), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4),
                                     out_dtype=torch.bfloat16), "weight has dtype"),
    (lambda: scaled_linear_quantized(_fp8(2, 6), torch.ones(2, 1), _fp8(4, 8), torch.ones(4),
                                     out_dtype=torch.bfloat16), r"x_q.shape\[1\] is 6, expected 8"),
    (lambda: scaled_linear_quantized(_fp8(2, 8), torch.ones(3, 1), _fp8(4, 8), torch.ones(4),
                                     out_dtype=torch.bfloat16), "x_scale must be"),
    (lambda: scaled_linear_quantized(_fp8(2, 8), torch.ones(2, 1).half(), _fp8(4, 8), torch.ones(4),
                                     out_dtype=torch.bfloat16), "x_scale has dtype"),
    (lambda: scaled_linear_quantized(_fp8(2, 8), torch.ones(2, 1), _fp8(4, 8), torch.ones(3),
                                     out_dtype=torch.bfloat16), r"weight_scale.shape\[0\] is 3, expected 4"),
    (lambda: scaled_linear_quantized(_fp8(2, 8), torch.ones(2, 1), _fp8(4, 8), torch.ones(4), torch.ones(4),
                                     out_dtype=torch.bfloat16), "bias has dtype"),
    (lambda: scaled_linear_quantized(_fp8(2, 8), torch.ones(2, 1), _fp8(4, 8), torch.ones(4),
                                     out_dtype=torch.int32), "out_dtype is torch.int32"),
])
def test_wrappers_reject_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- CPU: the kernels under Triton's interpreter ---


def interpreted_checks() -> None:
    """float16 and float32 only: the interpreter rounds float32 to bfloat16 by truncation (the GPU rounds to
    nearest), so bfloat16 is checked on CUDA. Norm widths are powers of two in float32: the kernel multiplies
    the sum of squares by 1/H as torch's CUDA mean does, the CPU reference divides by H, and float32 keeps
    that ulp where float16 rounds it away."""
    gen = torch.Generator().manual_seed(0)
    # (T, H, I, dtype): H = 512 one row a program; H = 64 32 rows a program (T = 3 masks the rest); H = 96
    # masked columns. I = 320 one masked block; I = 5000 two row blocks (dynamic), five programs (static).
    for t, h, inter, dtype in ((5, 512, 320, torch.float16), (5, 512, 5000, torch.float32),
                               (3, 64, 320, torch.float32), (1, 96, 5000, torch.float16)):
        x, residual = exact_norm_input(t, h, gen, dtype=dtype), exact_norm_input(t, h, gen, dtype=dtype)
        weight = (torch.randn(h, generator=gen) * 2).to(dtype)
        gate_up = (torch.randn(t, 2 * inter, generator=gen) * 4).to(dtype)
        if t > 1:
            x[1], residual[1], gate_up[1] = 0, 0, 0
        for mode in ("dynamic", "static"):
            refs = compositions(x, residual, weight, gate_up, mode)
            got = kernel_outputs(x, residual, weight, gate_up, refs)
            for op, (_, ref, composition) in refs.items():
                what = f"{op} T={t} H={h} I={inter} {dtype} {mode}"
                assert_same_quantized(ref, composition, what + " (reference)")
                assert_same_quantized(got[op], ref, what)


def interpreted_gemm_checks() -> None:
    """scaled_linear_quantized's CUDA function on a quantized input is scaled_linear's on the float input: the
    same GEMM launch (tile heuristic, tuned settings), so the same bits; a [1] scale gives them too."""
    from kiln.plugins import tuning
    from kiln.plugins.triton_scaled_linear import (
        TUNED_KERNEL,
        quantize_activations_triton,
        scaled_linear_quantized_triton,
        scaled_linear_triton,
        tuning_key,
    )

    gen = torch.Generator().manual_seed(1)
    n, k = 40, 256
    for t, dtype, split in ((1, torch.float16, 2), (5, torch.float32, None), (33, torch.float16, None)):
        x = (torch.randn(t, k, generator=gen) * 4).to(dtype)
        weight, weight_scale = random_fp8_weight(n, k, gen)
        bias = torch.randn(n, generator=gen).to(dtype) if t > 1 else None
        if split:
            tuning.install({TUNED_KERNEL: {tuning_key(t, n, k, False): {
                "block_n": 32, "split_k": split, "num_warps": 4, "num_stages": 2}}})
        for input_scale in (None, static_scale(x)):
            x_q, x_scale = quantize_activations_triton(x, FP8, k, input_scale)
            want = scaled_linear_triton(x, weight, weight_scale, input_scale, bias, None)
            got = scaled_linear_quantized_triton(x_q, x_scale, weight, weight_scale, bias, dtype)
            assert torch.equal(got, want), f"T={t} {dtype} static={input_scale is not None}"
            if input_scale is not None:
                got = scaled_linear_quantized_triton(x_q, input_scale, weight, weight_scale, bias, dtype)
                assert torch.equal(got, want), f"T={t} {dtype} [1] scale"
        tuning.clear()


_RUN = """
import sys
sys.path.insert(0, {tests!r})
import test_norm_quant as checks
checks.{name}()
print("ok")
"""


@needs_triton
@pytest.mark.parametrize("name", ["interpreted_checks", "interpreted_gemm_checks"])
def test_interpreted_kernels_match_the_references(name):
    out = run_interpreted(_RUN.format(tests=str(Path(__file__).parent), name=name))
    assert out.strip().endswith("ok")


# --- CUDA ---

needs_cuda_kernels = pytest.mark.skipif(not (torch.cuda.is_available() and USE_TRITON),
                                        reason="needs CUDA and triton (with KILN_DISABLE_TRITON unset)")
HIDDEN, INTER = 4096, 14336  # Llama-3.1-8B


def _cuda_inputs(t: int, dtype: torch.dtype, exact: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    if exact:
        x, residual = exact_norm_input(t, HIDDEN, gen, "cuda", dtype), exact_norm_input(t, HIDDEN, gen, "cuda", dtype)
    else:
        x = (torch.randn(t, HIDDEN, generator=gen) * 2).to("cuda", dtype)
        x[0, :: HIDDEN // 8] *= 40  # outliers, as real activations have
        residual = torch.randn(t, HIDDEN, generator=gen).to("cuda", dtype)
    weight = (torch.rand(HIDDEN, generator=gen) + 0.5).to("cuda", dtype)
    gate_up = (torch.randn(t, 2 * INTER, generator=gen) * 4).to("cuda", dtype)
    return x, residual, weight, gate_up


def assert_quantized_close(got, want, dtype, what: str) -> None:
    """For realistic norm inputs: the kernel's sum of squares, in another order than torch's, can move a
    normalized value by an ulp of x's dtype now and then. So: scales equal but for a few rows (dynamic: that
    value was the row's amax), within an ulp of x's dtype; FP8 values equal but for a few, and those one
    e4m3 step apart after scaling."""
    (q, s), (q_ref, s_ref) = got[:2], want[:2]
    assert q.shape == q_ref.shape and s.shape == s_ref.shape, what
    torch.testing.assert_close(s, s_ref, rtol=torch.finfo(dtype).eps, atol=0, msg=what)
    assert (s != s_ref).sum().item() <= 1 + s.numel() // 100, f"{what}: scales"
    a, b = q.float() * s, q_ref.float() * s_ref
    # Each side is within half a step (2^-4 relative) of its float value, which differ by an ulp at most.
    bound = (2.0 ** -3 + 2.0 ** -7) * torch.maximum(a.abs(), b.abs()) + 2.0 ** -9 * s
    assert ((a - b).abs() <= bound).all(), f"{what}: steps"
    same_rows = (s == s_ref)[:, 0]
    bad = (q[same_rows].view(torch.uint8) != q_ref[same_rows].view(torch.uint8)).sum().item()
    assert bad <= 2 + q.numel() // 1000, f"{what}: {bad} of {q.numel()} bytes differ"
    for extra, extra_ref in zip(got[2:], want[2:]):
        assert torch.equal(extra, extra_ref), f"{what}: the residual sum"


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("mode", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 16, 300])
def test_kernels_match_the_references_at_llama_shapes(t, dtype, mode):
    for exact in (True, False):
        x, residual, weight, gate_up = _cuda_inputs(t, dtype, exact, seed=t)
        refs = compositions(x, residual, weight, gate_up, mode)
        got = kernel_outputs(x, residual, weight, gate_up, refs)
        for op, (_, ref, composition) in refs.items():
            what = f"{op} T={t} {dtype} {mode} exact={exact}"
            assert_same_quantized(ref, composition, what + " (reference)")
            if exact or op == "silu_and_mul_quant":  # no reduction order at stake: bit for bit
                assert_same_quantized(got[op], ref, what)
            else:
                assert_quantized_close(got[op], ref, dtype, what)


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("mode", ["dynamic", "static"])
@pytest.mark.parametrize("t", [1, 16, 300, 1024])
def test_scaled_linear_quantized_is_scaled_linear_on_cuda(t, mode):
    """Through the Triton GEMM (T <= 16, or a bias) and cuBLASLt (T >= 17, bfloat16, no bias) alike."""
    from test_kernels_scaled_linear import GPU_FP8_SUM_ERROR, assert_sum_order_close

    from kiln.plugins.quant_linear import scaled_linear_quantized_reference

    gen = torch.Generator().manual_seed(t)
    x, _, weight, _ = _cuda_inputs(t, torch.bfloat16, True, seed=t)
    input_scale = torch.tensor([0.01], device="cuda") if mode == "static" else None
    x_q, x_scale = rms_norm_quant(x, weight, EPS, input_scale)  # the kernel, equal to the reference here
    normed = rms_norm_reference(x, weight, EPS)
    for n in (6144, 4096):
        w, w_scale = (v.cuda() for v in random_fp8_weight(n, HIDDEN, gen))
        for bias in (None, torch.randn(n, generator=gen).to("cuda", torch.bfloat16)):
            want = scaled_linear(normed, w, w_scale, input_scale, bias)
            got = scaled_linear_quantized(x_q, x_scale, w, w_scale, bias, out_dtype=torch.bfloat16)
            assert torch.equal(got, want), f"T={t} N={n} {mode} bias={bias is not None}"
            if input_scale is not None:
                assert torch.equal(scaled_linear_quantized(x_q, input_scale, w, w_scale, bias,
                                                           out_dtype=torch.bfloat16), want)
            ref = scaled_linear_quantized_reference(x_q, x_scale, w, w_scale, bias, torch.bfloat16)
            abs_sum = (x_q.float().abs() @ w.float().abs().t()) * x_scale * w_scale[None, :]
            assert_sum_order_close(got, ref, abs_sum, GPU_FP8_SUM_ERROR, f"T={t} N={n} {mode} vs reference")


@pytest.mark.gpu
@needs_cuda_kernels
def test_fused_ops_run_their_kernels_inside_a_cuda_graph():
    """The ops dispatch to the kernels, which read the static scale on the GPU: a decode step's fused norms,
    activation and FP8 GEMMs capture in one CUDA graph, and a replay on new inputs gives eager results."""
    from cuda_graph_capture import capture

    for op in ("rms_norm_quant", "fused_add_rms_norm_quant", "silu_and_mul_quant", "scaled_linear_quantized"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kiln::{op}", "CUDA"), op
    t = 8
    x, residual, weight, gate_up = _cuda_inputs(t, torch.bfloat16, False, seed=5)
    gen = torch.Generator().manual_seed(5)
    w_qkv, s_qkv = (v.cuda() for v in random_fp8_weight(6144, HIDDEN, gen))
    w_down, s_down = (v.cuda() for v in random_fp8_weight(HIDDEN, INTER, gen))
    static = torch.tensor([0.02], device="cuda")

    def step():
        x_q, x_scale, summed = fused_add_rms_norm_quant(x, residual, weight, EPS, static)
        qkv = scaled_linear_quantized(x_q, x_scale, w_qkv, s_qkv, out_dtype=torch.bfloat16)
        h_q, h_scale = silu_and_mul_quant(gate_up)
        down = scaled_linear_quantized(h_q, h_scale, w_down, s_down, out_dtype=torch.bfloat16)
        return [qkv, down, summed, *rms_norm_quant(x, weight, EPS)]

    graph, outs = capture(step)
    x.copy_(torch.randn(t, HIDDEN, generator=gen).to("cuda", torch.bfloat16))
    gate_up.copy_(torch.randn(t, 2 * INTER, generator=gen).to("cuda", torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    for i, (out, eager) in enumerate(zip(outs, step())):
        assert torch.equal(out.view(torch.uint8) if out.dtype == FP8 else out,
                           eager.view(torch.uint8) if eager.dtype == FP8 else eager), i
