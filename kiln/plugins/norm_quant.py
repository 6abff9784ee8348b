"""RMSNorm, residual-add + RMSNorm and SiLU-and-mul that hand the next FP8 linear its quantized input.

Each is the composition of two existing references: the float operator (norm.py, activation.py), its output
rounded to x's dtype as that operator returns it, then scaled_linear's activation quantization for FP8
weights (quant_linear.quantize_activations: static per-tensor scale, or dynamic per token: row amax / 448
floored at MIN_DYNAMIC_SCALE; x / scale saturated at +-448 and cast to float8_e4m3fn). A following
scaled_linear_quantized(x_q, x_scale, ...) therefore computes what scaled_linear(float output, ...) does, and
on CUDA the quantization is no launch of its own: the norm or activation kernel writes FP8 directly.

x_scale is [T, 1] float32 in both modes. A static scale is repeated over the rows (one store per row in the
kernels) because per-row scales are what the GEMM kernels and cuBLASLt's row-wise scaling read, and because
an op may not return its input tensor as an output.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_dims, check_dtype, check_last_dim_contiguous, check_same_device
from ._spec import OpSpec, define
from .activation import silu_and_mul_reference
from .norm import _check as _check_norm_args
from .norm import fused_add_rms_norm_reference, rms_norm_reference
from .quant_linear import _check_vector, quantize_activations

FP8 = torch.float8_e4m3fn


def _quantize_rows(y: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    # y: [T, D] float, the float operator's output -> (x_q [T, D] float8_e4m3fn, x_scale [T, 1] float32)
    x_q, s_x = quantize_activations(y.float(), FP8, input_scale)
    return x_q, s_x if input_scale is None else input_scale.expand(y.shape[0], 1).clone()


def rms_norm_quant_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_rows(rms_norm_reference(x, weight, eps), input_scale)


def fused_add_rms_norm_quant_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    normed, new_residual = fused_add_rms_norm_reference(x, residual, weight, eps)
    x_q, x_scale = _quantize_rows(normed, input_scale)
    return x_q, x_scale, new_residual


def silu_and_mul_quant_reference(
    x: torch.Tensor, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_rows(silu_and_mul_reference(x), input_scale)


def _fake_quantized(x: torch.Tensor, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.new_empty((x.shape[0], features), dtype=FP8),
            x.new_empty((x.shape[0], 1), dtype=torch.float32))


def _rms_norm_quant_fake(x, weight, eps, input_scale):
    return _fake_quantized(x, x.shape[1])


def _fused_add_rms_norm_quant_fake(x, residual, weight, eps, input_scale):
    return (*_fake_quantized(x, x.shape[1]), torch.empty_like(x))


def _silu_and_mul_quant_fake(x, input_scale):
    return _fake_quantized(x, x.shape[1] // 2)


# The rows the three ops share: the quantization's input scale and its two results.
_QUANTIZED = """
    Tensor? input_scale   [1] float32, the next linear's static activation scale; None: dynamic, per token
    -> Tensor             x_q: [T, F] float8_e4m3fn, F the float operator's output features
    -> Tensor             x_scale: [T, 1] float32, each row's scale
"""

RMS_NORM_QUANT = OpSpec("kiln::rms_norm_quant", """
    Tensor x              [T, H] float32 / float16 / bfloat16, last dim contiguous
    Tensor weight         [H] x's dtype
    float eps             as rms_norm's
    """ + _QUANTIZED, reference=rms_norm_quant_reference, fake=_rms_norm_quant_fake,
    kernel="triton_norm_quant.rms_norm_quant_triton")
FUSED_ADD_RMS_NORM_QUANT = OpSpec("kiln::fused_add_rms_norm_quant", """
    Tensor x              [T, H] float32 / float16 / bfloat16, last dim contiguous
    Tensor residual       [T, H] x's dtype, last dim contiguous
    Tensor weight         [H] x's dtype
    float eps             as rms_norm's
    """ + _QUANTIZED + """
    -> Tensor             [T, H] x + residual in x's dtype
    """, reference=fused_add_rms_norm_quant_reference, fake=_fused_add_rms_norm_quant_fake,
    kernel="triton_norm_quant.fused_add_rms_norm_quant_triton")
SILU_AND_MUL_QUANT = OpSpec("kiln::silu_and_mul_quant", """
    Tensor x              [T, 2I] = [gate | up] float32 / float16 / bfloat16, last dim contiguous
    """ + _QUANTIZED, reference=silu_and_mul_quant_reference, fake=_silu_and_mul_quant_fake,
    kernel="triton_norm_quant.silu_and_mul_quant_triton")
_rms_norm_quant = define(RMS_NORM_QUANT)
_fused_add_rms_norm_quant = define(FUSED_ADD_RMS_NORM_QUANT)
_silu_and_mul_quant = define(SILU_AND_MUL_QUANT)


def _check_x(x: torch.Tensor, input_scale: torch.Tensor | None) -> None:
    check_dims("x", x, 2)
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    if x.shape[1] == 0:
        raise ValueError(f"x has no features to quantize: shape {tuple(x.shape)}")
    if input_scale is not None:
        _check_vector("input_scale", input_scale, 1, (torch.float32,), "one per-tensor scale")
        check_same_device(x=x, input_scale=input_scale)


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm quantized to FP8 for the next linear: (x_q, x_scale) = the quantization of rms_norm(x, weight,
    eps) that scaled_linear applies.

    x: [T, H] float (last dim contiguous); weight: [H], x's dtype; input_scale: [1] float32, the linear's
    static activation scale, or None for dynamic per-token scales. -> x_q: [T, H] float8_e4m3fn,
    x_scale: [T, 1] float32 (static: input_scale on every row).
    """
    _check_x(x, input_scale)
    _check_norm_args(x, weight)
    return _rms_norm_quant.for_tensor(x)(x, weight, float(eps), input_scale)


def fused_add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    input_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adds the residual, normalizes and quantizes: (x_q, x_scale, x + residual), where (x_q, x_scale) is
    rms_norm_quant of x + residual (as fused_add_rms_norm rounds it to x's dtype).

    x, residual: [T, H], same dtype, last dims contiguous; weight: [H]; input_scale as rms_norm_quant.
    """
    _check_x(x, input_scale)
    _check_norm_args(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x: got {tuple(residual.shape)} {residual.dtype}, x is {tuple(x.shape)} {x.dtype}"
        )
    check_last_dim_contiguous("residual", residual)
    check_same_device(x=x, residual=residual)
    return _fused_add_rms_norm_quant.for_tensor(x)(x, residual, weight, float(eps), input_scale)


def silu_and_mul_quant(
    x: torch.Tensor, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up quantized to FP8 for the down projection: the quantization of silu_and_mul(x) that
    scaled_linear applies. x: [T, 2I] = [gate | up] float (last dim contiguous); input_scale as
    rms_norm_quant. -> x_q: [T, I] float8_e4m3fn, x_scale: [T, 1] float32.
    """
    check_dims("x", x, 2)
    if x.shape[1] % 2:
        raise ValueError(f"x.shape[-1] must be even (gate and up halves), got {x.shape[1]}")
    _check_x(x, input_scale)
    return _silu_and_mul_quant.for_tensor(x)(x, input_scale)
