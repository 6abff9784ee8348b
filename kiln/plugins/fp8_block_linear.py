"""Block-scaled FP8 linear (DeepSeek-V3's and Qwen3's FP8 releases): y = x @ W^T (+ bias), W in FP8 E4M3
with one float32 scale per [b0, b1] block of the weight, activations quantized at run time to FP8 per token
and per group of b1 input columns.

The reference computes what the block GEMM kernels do (DeepSeek's `w8a8_block_fp8_matmul`, vLLM's, DeepGEMM):
each group of b1 input columns is a float32 partial sum of FP8 products, multiplied by the token's scale of
that group and then by the weight block's scale, and the groups are summed in float32. Products of two e4m3
values are exact in float32, so what remains between reference and kernel is the order of the float32 sums.
On CUDA the op runs the Triton kernel of triton_fp8_block_linear.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._checks import (
    FLOAT_DTYPES,
    check_dims,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    check_size,
)
from ._spec import OpSpec, define
from .quant_limits import FP8_MAX, MIN_DYNAMIC_SCALE


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_activation_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] float -> (x_q [T, G, group] float8_e4m3fn, s_x [T, G] float32), G = ceil(K / group).

    Each token's group of `group` input columns gets scale = its amax / 448 (floored, so an all-zero group
    gives zeros, not NaN); the last group of a K that `group` does not divide is padded with zeros, which
    change neither its amax nor any sum.
    """
    t, k = x.shape
    g = _cdiv(k, group)
    xs = torch.nn.functional.pad(x.float(), (0, g * group - k)).view(t, g, group)  # [T, G, group]
    # 448 as a tensor on x's device: CUDA divides by a Python scalar as a multiplication by its reciprocal,
    # which is 1 ulp off now and then; a tensor divisor gives the same IEEE quotient on every device.
    amax = xs.abs().amax(dim=-1)  # [T, G]
    s_x = (amax / torch.full((), FP8_MAX, device=x.device)).clamp(min=MIN_DYNAMIC_SCALE)  # [T, G]
    # Saturate explicitly: e4m3fn has no infinity, and a cast's choice for an out-of-range value is its own.
    x_q = (xs / s_x[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [T, G, group]
    return x_q, s_x


def fp8_block_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: list[int],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    b0, b1 = block_size
    n, k = weight.shape
    x_q, s_x = quantize_activation_groups(x, b1)  # [T, G, b1], [T, G]
    w = weight.float()  # [N, K]
    row_scales = weight_scale_inv.repeat_interleave(b0, dim=0)[:n]  # [N, G]: each row's block scales
    y = x.new_zeros((x.shape[0], n), dtype=torch.float32)  # [T, N]
    # One group at a time, as the kernels' K loop runs: memory stays O(T * N) whatever the number of groups.
    for g in range(s_x.shape[1]):
        start, end = g * b1, min((g + 1) * b1, k)
        partial = x_q[:, g, : end - start].float() @ w[:, start:end].t()  # [T, N], float32 sums
        y += partial * s_x[:, g, None] * row_scales[None, :, g]  # the kernels' (acc * a_s) * b_s
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _fp8_block_linear_fake(x, weight, weight_scale_inv, block_size, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


FP8_BLOCK_LINEAR = OpSpec("kiln::fp8_block_linear", """
    Tensor x                  [T, K] float32 / float16 / bfloat16, last dim contiguous
    Tensor weight             [N, K] float8_e4m3fn, contiguous
    Tensor weight_scale_inv   [ceil(N / b0), ceil(K / b1)] float32, multiplies each weight block
    SymInt[] block_size       [b0, b1]: the rows and columns of a weight block
    Tensor? bias              [N] x's dtype
    -> Tensor                 [T, N] x's dtype
    """, reference=fp8_block_linear_reference, fake=_fp8_block_linear_fake,
    kernel="triton_fp8_block_linear.fp8_block_linear_triton")
_fp8_block_linear = define(FP8_BLOCK_LINEAR)


def _check_block_size(block_size: Sequence[int]) -> list[int]:
    sizes = list(block_size) if isinstance(block_size, (tuple, list)) else None
    if sizes is None or len(sizes) != 2 or any(type(b) is not int or b <= 0 for b in sizes):
        raise ValueError(f"block_size must be two positive ints (rows, columns of a weight block), got {block_size!r}")
    return sizes


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: Sequence[int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-scaled FP8 linear: x: [T, K] float32/float16/bfloat16 (last dim contiguous) -> [T, N] in x's dtype.

    weight: [N, K] torch.float8_e4m3fn, contiguous. block_size: (b0, b1), the rows and columns of a weight
    block. weight_scale_inv: [ceil(N / b0), ceil(K / b1)] float32; despite the checkpoints' name it
    multiplies: weight[n, k]'s real value is weight[n, k] * weight_scale_inv[n // b0, k // b1]. N and K need
    not be multiples of the block (the last blocks are partial). The activations are quantized per token and
    per group of b1 input columns (scale = the group's amax / 448). bias: [N] in x's dtype, added last.
    """
    sizes = _check_block_size(block_size)
    check_dims("weight", weight, 2)
    check_dtype("weight", weight, (torch.float8_e4m3fn,))
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got strides {weight.stride()}")
    n, k = weight.shape
    if k == 0:
        raise ValueError("weight has K = 0 input features")
    check_dims("x", x, 2)
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    check_size("x", x, 1, k, "input features of the weight")
    check_dims("weight_scale_inv", weight_scale_inv, 2)
    check_dtype("weight_scale_inv", weight_scale_inv, (torch.float32,))
    check_size("weight_scale_inv", weight_scale_inv, 0, _cdiv(n, sizes[0]),
               f"row blocks: ceil(N = {n} / {sizes[0]})")
    check_size("weight_scale_inv", weight_scale_inv, 1, _cdiv(k, sizes[1]),
               f"column blocks: ceil(K = {k} / {sizes[1]})")
    tensors = {"x": x, "weight": weight, "weight_scale_inv": weight_scale_inv}
    if bias is not None:
        check_dims("bias", bias, 1)
        check_dtype("bias", bias, (x.dtype,))
        check_size("bias", bias, 0, n, "output features of the weight")
        tensors["bias"] = bias
    check_same_device(**tensors)
    return _fp8_block_linear.for_tensor(x)(x, weight, weight_scale_inv, sizes, bias)
