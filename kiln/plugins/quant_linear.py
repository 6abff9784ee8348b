"""Quantized linear layers: y = x @ W^T (+ bias) with W stored in 8 or 4 bits.

Two kinds of operator, after the quantization formats kiln builds:
- `scaled_linear` (W8A8, FP8 e4m3 or INT8): the activations are quantized too, with a static per-tensor
  scale or a dynamic per-token one, and the product runs on quantized values; the scales multiply the
  accumulator afterwards. `scaled_linear_quantized` is its GEMM alone (FP8), for activations that their
  producer quantized already (norm_quant.py).
- `weight_only_linear` (W8A16, W4A16 with groups, e.g. AWQ / GPTQ): the weight is dequantized to the
  activation dtype and multiplied in floating point.

The references follow "dequantize, compute in float32, round exactly as the GPU kernel will": each
rounding step a kernel takes (activation quantization, the dequantized weight in the activation dtype)
happens here too, so a kernel can be tested against them tightly. On CUDA the ops run Triton kernels
(triton_scaled_linear.py, triton_weight_only.py); KILN_DISABLE_TRITON=1 runs these references there too.
"""

from __future__ import annotations

import torch

from ._checks import (
    FLOAT_DTYPES,
    check_dims,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    check_size,
)
from ._eager import runs_reference_directly
from ._spec import OpSpec, define
from .int4_pack import unpack_int4
from .quant_limits import FP8_MAX, INT8_MAX, MIN_DYNAMIC_SCALE

SCALED_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.int8)


def _int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a: [T, K] int8 @ b: [N, K] int8 ^T -> [T, N] int32, the exact integer sums (what an int32
    accumulator gives; exact while K < 2^31 / 128^2 = 131072)."""
    # float32 is not exact: products reach 128^2 and sums pass 2^24 within a few thousand columns.
    # torch._int_mm accumulates in int32: on the CPU it takes any shape (seen in torch 2.11 and 2.13; a build
    # without the CPU kernel raises and falls back) but beats float64 only for one row (torch 2.13, 2 threads:
    # [1, 512] x [512, 1536] 0.43 ms against 0.90; 8 rows of 384 x 1152 2.3 ms against 0.63; 256 rows of
    # 512 x 1536 102 ms against 8.4), on CUDA it wants T > 16 and K, N multiples of 8. Elsewhere float64 is exact:
    # every product and partial sum is an integer far below 2^53.
    t, k = a.shape
    n = b.shape[0]
    int_mm = getattr(torch, "_int_mm", None)
    if int_mm is not None and (t == 1 if a.device.type == "cpu" else (t > 16 and k % 8 == 0 and n % 8 == 0)):
        try:
            return int_mm(a, b.t())
        except (RuntimeError, NotImplementedError):  # a build without the kernel: float64 below
            pass
    return (a.double() @ b.double().t()).to(torch.int32)


def quantize_activations(
    xs: torch.Tensor, qdtype: torch.dtype, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled_linear's activation quantization, the reference every kernel that quantizes for it is held to.

    xs: [T, K] float32 (already smoothed) -> (x_q [T, K] qdtype, s_x): s_x is input_scale ([1] float32, static)
    or, with input_scale None, [T, 1] float32, each row's amax / qmax floored at MIN_DYNAMIC_SCALE.
    qdtype: torch.float8_e4m3fn (qmax 448, saturated) or torch.int8 (qmax 127, rounded half to even).
    """
    fp8 = qdtype == torch.float8_e4m3fn
    qmax = FP8_MAX if fp8 else INT8_MAX
    if input_scale is None:
        # qmax as a tensor on x's device: CUDA divides by a Python scalar as a multiplication by its reciprocal,
        # which is 1 ulp off now and then; a tensor divisor gives the same IEEE quotient on every device.
        amax = xs.abs().amax(dim=-1, keepdim=True)  # [T, 1]
        s_x = (amax / torch.full((), qmax, device=xs.device)).clamp(min=MIN_DYNAMIC_SCALE)  # [T, 1]
    else:
        s_x = input_scale  # [1]
    if fp8:
        # Saturate explicitly rather than leave an out-of-range value to the cast: e4m3fn has no infinity,
        # and what a conversion makes of 1000.0 is its own choice (torch's CPU cast happens to give 448).
        x_q = (xs / s_x).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [T, K]
    else:
        x_q = torch.round(xs / s_x).clamp(-128, 127).to(torch.int8)  # round half to even, as cvt.rni does
    return x_q, s_x


def _scaled_gemm(x_q: torch.Tensor, s_x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    # x_q: [T, K] weight's dtype; s_x: [T, 1] or [1] float32; weight: [N, K]; weight_scale: [N] -> [T, N] out_dtype
    if weight.dtype == torch.float8_e4m3fn:
        # Products of two e4m3 values are exact in float32; the sum rounds as a float32 accumulator does.
        acc = x_q.float() @ weight.float().t()  # [T, N]
    else:
        acc = _int8_matmul(x_q, weight).float()  # [T, N]
    y = acc * s_x * weight_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def scaled_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    pre_quant_scale: torch.Tensor | None,
) -> torch.Tensor:
    xs = x.float()
    if pre_quant_scale is not None:
        xs = xs * pre_quant_scale
    x_q, s_x = quantize_activations(xs, weight.dtype, input_scale)
    return _scaled_gemm(x_q, s_x, weight, weight_scale, bias, x.dtype)


def _linear_fake(x, weight, weight_scale, input_scale, bias, pre_quant_scale):
    return x.new_empty((x.shape[0], weight.shape[0]))


SCALED_LINEAR = OpSpec("kiln::scaled_linear", """
    Tensor x                  [T, K] float32 / float16 / bfloat16, last dim contiguous
    Tensor weight             [N, K] float8_e4m3fn or int8, contiguous
    Tensor weight_scale       [N] float32: weight[n, k] means weight[n, k] * weight_scale[n]
    Tensor? input_scale       [1] float32 static activation scale, or None: dynamic, per token
    Tensor? bias              [N] x's dtype, added last
    Tensor? pre_quant_scale   [K] float32, multiplies x before quantization (smoothing)
    -> Tensor                 [T, N] x's dtype
    """, reference=scaled_linear_reference, fake=_linear_fake, kernel="triton_scaled_linear.scaled_linear_triton")
_scaled_linear = define(SCALED_LINEAR)


def _check_vector(name: str, t: torch.Tensor, size: int, dtypes: tuple[torch.dtype, ...], what: str) -> None:
    check_dims(name, t, 1)
    check_dtype(name, t, dtypes)
    check_size(name, t, 0, size, what)


def _check_x(x: torch.Tensor, k: int, what: str) -> None:
    check_dims("x", x, 2)
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    check_size("x", x, 1, k, what)


def _check_bias_and_smoothing(x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None,
                              pre_quant_scale: torch.Tensor | None) -> None:
    if bias is not None:
        _check_vector("bias", bias, n, (x.dtype,), "output features of the weight")
    if pre_quant_scale is not None:
        _check_vector("pre_quant_scale", pre_quant_scale, k, (torch.float32,), "input features of the weight")


def _optional(**tensors: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {name: t for name, t in tensors.items() if t is not None}


def _check_scaled_weight(weight: torch.Tensor, weight_scale: torch.Tensor,
                         dtypes: tuple[torch.dtype, ...]) -> tuple[int, int]:
    """Checks a W8A8 weight and its per-row scales; returns the weight's (N, K)."""
    check_dims("weight", weight, 2)
    check_dtype("weight", weight, dtypes)
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got strides {weight.stride()}")
    n, k = weight.shape
    if k == 0:
        raise ValueError("weight has K = 0 input features")
    _check_vector("weight_scale", weight_scale, n, (torch.float32,), "output features of the weight")
    return n, k


def scaled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    pre_quant_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8 linear: x: [T, K] float (last dim contiguous) -> [T, N] in x's dtype.

    weight: [N, K] torch.float8_e4m3fn (FP8) or torch.int8 (INT8), contiguous; its real value is
    weight[n, k] * weight_scale[n], weight_scale: [N] float32 (per-tensor or per-slice scales of a fused
    layer are expanded to rows by the caller). input_scale: [1] float32, a static per-tensor activation
    scale, or None for a dynamic per-token one (each row's amax / qmax, qmax = 448 for FP8, 127 for INT8).
    pre_quant_scale: [K] float32 multiplies x before quantization (SmoothQuant / AWQ smoothing).
    bias: [N] in x's dtype, added after the scales.
    """
    n, k = _check_scaled_weight(weight, weight_scale, SCALED_WEIGHT_DTYPES)
    _check_x(x, k, "input features of the weight")
    if input_scale is not None:
        _check_vector("input_scale", input_scale, 1, (torch.float32,), "one per-tensor scale")
    _check_bias_and_smoothing(x, n, k, bias, pre_quant_scale)
    check_same_device(x=x, weight=weight, weight_scale=weight_scale,
                      **_optional(input_scale=input_scale, bias=bias, pre_quant_scale=pre_quant_scale))
    return _scaled_linear.for_tensor(x)(x, weight, weight_scale, input_scale, bias, pre_quant_scale)


def scaled_linear_quantized_reference(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return _scaled_gemm(x_q, x_scale, weight, weight_scale, bias, out_dtype)


def _scaled_linear_quantized_fake(x_q, x_scale, weight, weight_scale, bias, out_dtype):
    return x_q.new_empty((x_q.shape[0], weight.shape[0]), dtype=out_dtype)


SCALED_LINEAR_QUANTIZED = OpSpec("kiln::scaled_linear_quantized", """
    Tensor x_q             [T, K] float8_e4m3fn, last dim contiguous
    Tensor x_scale         [T, 1] float32, each row's scale, or [1] for all rows
    Tensor weight          [N, K] float8_e4m3fn, contiguous
    Tensor weight_scale    [N] float32
    Tensor? bias           [N] out_dtype
    ScalarType out_dtype   float32, float16 or bfloat16
    -> Tensor              [T, N] out_dtype
    """, reference=scaled_linear_quantized_reference, fake=_scaled_linear_quantized_fake,
    kernel="triton_scaled_linear.scaled_linear_quantized_triton")
_scaled_linear_quantized = define(SCALED_LINEAR_QUANTIZED)


def scaled_linear_quantized(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The GEMM half of an FP8 scaled_linear, on activations its producer quantized already (the fused
    norm and activation operators of norm_quant.py): x_q: [T, K] float8_e4m3fn (last dim contiguous) ->
    [T, N] out_dtype, equal to scaled_linear(x, ...) where (x_q, x_scale) is x's quantization.

    x_scale: [T, 1] float32, each row's scale (what the producers give, dynamic or static), or [1], one for
    all rows. weight: [N, K] float8_e4m3fn, contiguous; weight_scale: [N] float32; bias: [N] out_dtype.
    """
    n, k = _check_scaled_weight(weight, weight_scale, (torch.float8_e4m3fn,))
    check_dims("x_q", x_q, 2)
    check_dtype("x_q", x_q, (torch.float8_e4m3fn,))
    check_last_dim_contiguous("x_q", x_q)
    check_size("x_q", x_q, 1, k, "input features of the weight")
    check_dtype("x_scale", x_scale, (torch.float32,))
    if tuple(x_scale.shape) not in ((x_q.shape[0], 1), (1,)):
        raise ValueError(f"x_scale must be [T, 1] or [1] with T = {x_q.shape[0]} rows of x_q, got shape "
                         f"{tuple(x_scale.shape)}")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype is {out_dtype}; expected one of {[str(d) for d in FLOAT_DTYPES]}")
    if bias is not None:
        _check_vector("bias", bias, n, (out_dtype,), "output features of the weight")
    check_same_device(x_q=x_q, x_scale=x_scale, weight=weight, weight_scale=weight_scale, **_optional(bias=bias))
    return _scaled_linear_quantized.for_tensor(x_q)(x_q, x_scale, weight, weight_scale, bias, out_dtype)


def _dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                group_size: int, dtype: torch.dtype, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    # qweight: [N, K] int8 (8 bits, symmetric), [N, K] uint8 (8 bits, asymmetric) or [N, K // 2] uint8 (4 bits);
    # scales, zeros: [N, G]; g_idx: [K] int32 or None -> [N, K] dtype
    u = qweight.float() if bits == 8 else unpack_int4(qweight).float()  # [N, K]
    n, k = u.shape
    if g_idx is None:  # groups of consecutive columns: broadcast over [N, G, group_size], no [N, K] copies
        u = u.view(n, k // group_size, group_size)
        scales, zeros = scales[:, :, None], None if zeros is None else zeros[:, :, None]
    else:  # GPTQ's act-order: column k takes group g_idx[k]
        columns = g_idx.long()
        scales, zeros = scales[:, columns], None if zeros is None else zeros[:, columns]  # [N, K]
    if zeros is not None:  # asymmetric: the group's zero point is subtracted
        q = u - zeros.float()
    elif bits == 4:  # symmetric INT4 (ModelOpt's AWQ, GPTQ sym) stores q + 8
        q = u - 8.0
    else:  # symmetric INT8 is stored signed
        q = u
    return (q * scales).view(n, k).to(dtype)  # float32 products, one rounding to dtype


def _check_quantized_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                            group_size: int, g_idx: torch.Tensor | None = None) -> int:
    """Checks a weight-only quantized weight; returns its K (input features)."""
    if type(bits) is not int or bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    check_dims("qweight", qweight, 2)
    # 8 bits: signed values when symmetric, unsigned 0..255 with zero points when asymmetric.
    check_dtype("qweight", qweight, (torch.int8,) if bits == 8 and zeros is None else (torch.uint8,))
    if not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous, got strides {qweight.stride()}")
    n = qweight.shape[0]
    k = qweight.shape[1] * (8 // bits)
    if k == 0:
        raise ValueError("qweight has K = 0 input features")
    if type(group_size) is not int or group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size!r} must be a positive divisor of K = {k}")
    groups = k // group_size
    check_dims("scales", scales, 2)
    check_dtype("scales", scales, (torch.float32,))
    check_size("scales", scales, 0, n, "output features of qweight")
    check_size("scales", scales, 1, groups, f"groups: K = {k} / group_size = {group_size}")
    if zeros is not None:
        check_dims("zeros", zeros, 2)
        check_dtype("zeros", zeros, (torch.uint8,))
        check_size("zeros", zeros, 0, n, "output features of qweight")
        check_size("zeros", zeros, 1, groups, f"groups: K = {k} / group_size = {group_size}")
    if g_idx is not None:
        _check_vector("g_idx", g_idx, k, (torch.int32,), "input features of qweight")
        # The values are read only where that costs no device sync (a plain CPU tensor); on a GPU an index out
        # of range fails in the gather itself.
        if runs_reference_directly(g_idx) and k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise ValueError(f"g_idx holds groups {int(g_idx.min())}..{int(g_idx.max())}; they must be in "
                             f"0..{groups - 1} (K = {k} / group_size = {group_size})")
    check_same_device(qweight=qweight, scales=scales, **_optional(zeros=zeros, g_idx=g_idx))
    return k


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                      group_size: int, dtype: torch.dtype, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The real weight [N, K] in `dtype` of a weight-only quantized one, as weight_only_linear sees it.

    bits=8: qweight: [N, K] int8, symmetric (zeros None), or [N, K] uint8 u meaning u - zeros[n, g]
    (asymmetric). bits=4: qweight: [N, K // 2] uint8 from pack_int4, nibble u meaning u - 8 (zeros None) or
    u - zeros[n, g]. scales: [N, K // group_size] float32; zeros: [N, K // group_size] uint8 or None.
    g: the group of column k, k // group_size, or g_idx[k] when g_idx ([K] int32, GPTQ's act-order) is given.
    Value = q * scale in float32, then cast to dtype.
    """
    _check_quantized_weight(qweight, scales, zeros, bits, group_size, g_idx)
    return _dequantize(qweight, scales, zeros, bits, group_size, dtype, g_idx)


def weight_only_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None,
    pre_quant_scale: torch.Tensor | None,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    # A W4A16 kernel smooths x in its own dtype and multiplies it with the weight dequantized to that dtype.
    xs = x if pre_quant_scale is None else (x.float() * pre_quant_scale).to(x.dtype)
    w = _dequantize(qweight, scales, zeros, bits, group_size, x.dtype, g_idx)  # [N, K]
    y = xs.float() @ w.float().t()  # [T, N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _weight_only_linear_fake(x, qweight, scales, zeros, bits, group_size, bias, pre_quant_scale, g_idx=None):
    return x.new_empty((x.shape[0], qweight.shape[0]))


# The weight of a weight-only linear (dequantize_weight says what the values mean); shared with
# weight_only_linear_parts. All positional: torch.library takes no keyword-only Tensor arguments.
WEIGHT_ONLY_ARGS = """
    Tensor x                  [T, K] float32 / float16 / bfloat16, last dim contiguous
    Tensor qweight            [N, K] int8 (8 bits) / uint8 (8 bits, zeros), or [N, K // 2] uint8 (4 bits)
    Tensor scales             [N, K // group_size] float32
    Tensor? zeros             [N, K // group_size] uint8, the groups' zero points (asymmetric)
    SymInt bits               4 or 8
    SymInt group_size         input columns a scale covers; divides K
    Tensor? bias              [N] x's dtype, added last
"""

WEIGHT_ONLY_LINEAR = OpSpec("kiln::weight_only_linear", WEIGHT_ONLY_ARGS + """
    Tensor? pre_quant_scale   [K] float32, multiplies x first (in x's dtype)
    Tensor? g_idx=None        [K] int32, each input column's group (GPTQ act-order)
    -> Tensor                 [T, N] x's dtype
    """, reference=weight_only_linear_reference, fake=_weight_only_linear_fake,
    kernel="triton_weight_only.weight_only_linear_triton")
_weight_only_linear = define(WEIGHT_ONLY_LINEAR)


def weight_only_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    pre_quant_scale: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A16 / W4A16 linear: x: [T, K] float (last dim contiguous) -> [T, N] in x's dtype.

    The weight (see dequantize_weight for qweight, scales, zeros, g_idx) is dequantized to x's dtype and
    multiplied in float32. group_size divides K; per-channel weights pass group_size = K (scales [N, 1]).
    g_idx: [K] int32, each input column's group (GPTQ act-order), instead of column // group_size.
    pre_quant_scale: [K] float32 multiplies x (in x's dtype) first (AWQ smoothing). bias: [N] in x's dtype.
    """
    k = _check_quantized_weight(qweight, scales, zeros, bits, group_size, g_idx)
    _check_x(x, k, "input features of qweight")
    _check_bias_and_smoothing(x, qweight.shape[0], k, bias, pre_quant_scale)
    check_same_device(x=x, qweight=qweight, **_optional(bias=bias, pre_quant_scale=pre_quant_scale))
    return _weight_only_linear.for_tensor(x)(x, qweight, scales, zeros, bits, group_size, bias, pre_quant_scale,
                                             g_idx)
