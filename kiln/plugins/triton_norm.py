"""Triton kernels behind kiln::rms_norm and kiln::fused_add_rms_norm on CUDA.

Rounding follows the references in norm.py step by step: the residual sum is rounded to the input dtype
before it is normalized, x * rsqrt(mean(x^2) + eps) is computed in float32 and rounded to the input dtype,
and only then multiplied by the weight and rounded again. Only the order of the sum of squares differs from
torch's reduction, so an output element can, rarely, differ from the reference by one unit in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows shorter than this share a program, so per-head q/k norms (rows of head_dim) do not launch one tiny
# program per head.
_ELEMENTS_PER_PROGRAM = 2048


@triton.jit
def _row_starts(rows, rows_inner, stride_outer, stride_inner):
    # rows: [ROWS] flat row ids of an [outer, inner, H] view -> [ROWS, 1] int64 offsets of their starts
    rows = rows.to(tl.int64)
    return ((rows // rows_inner) * stride_outer + (rows % rows_inner) * stride_inner)[:, None]


# Row counts change every step: specializing on them (== 1, multiple of 16) would only add recompiles.
@triton.jit(do_not_specialize=["num_rows", "rows_inner"])
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    num_rows, rows_inner,
    stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner,
    stride_o_outer, stride_o_inner, stride_ro_outer, stride_ro_inner,
    eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = (rows < num_rows)[:, None] & (cols < HIDDEN)  # [ROWS, BLOCK]
    dtype = x_ptr.dtype.element_ty
    x_starts = _row_starts(rows, rows_inner, stride_x_outer, stride_x_inner)
    x = tl.load(x_ptr + x_starts + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r_starts = _row_starts(rows, rows_inner, stride_r_outer, stride_r_inner)
        residual = tl.load(residual_ptr + r_starts + cols, mask=mask, other=0.0)
        # The reference normalizes x + residual as rounded to the input dtype, and returns that sum.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        ro_starts = _row_starts(rows, rows_inner, stride_ro_outer, stride_ro_inner)
        tl.store(residual_out_ptr + ro_starts + cols, x, mask=mask)
    xf = x.to(tl.float32)
    # torch's CUDA mean multiplies the sum by 1/H rather than dividing by H; so do we.
    variance = tl.sum(xf * xf, axis=1) * (1.0 / HIDDEN)  # [ROWS]
    normed = (xf * tl.math.rsqrt(variance + eps)[:, None]).to(dtype)
    weight = tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0)
    # A product of two 16-bit floats is exact in float32, so this rounds once, like torch's dtype multiply.
    out = (weight.to(tl.float32) * normed.to(tl.float32)).to(dtype)
    o_starts = _row_starts(rows, rows_inner, stride_o_outer, stride_o_inner)
    tl.store(out_ptr + o_starts + cols, out, mask=mask)


def _fold_rows(t: torch.Tensor) -> torch.Tensor | None:
    """t: [..., H] as an [outer, inner, H] view, or None if its leading dims do not fold into two levels.

    Two levels cover contiguous rows and the per-head views of a fused qkv output ([T, heads, D] with
    strides (qkv_width, D, 1)) without a copy.
    """
    while t.dim() < 3:
        t = t.unsqueeze(0)
    try:
        return t.view(-1, *t.shape[-2:])
    except RuntimeError:
        return None


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, ...]:
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else out
    outs = (out, residual_out) if residual is not None else (out,)
    if x.numel() == 0:
        return outs
    x3 = _fold_rows(x)
    if x3 is None:
        # A >3-D view whose leading dims do not fold (the models make none): normalize a copy, then copy
        # into outputs laid out like empty_like(x), as the fake implementations promise.
        for o, result in zip(outs, _launch(x.contiguous(), residual, weight, eps)):
            o.copy_(result)
        return outs
    r3 = _fold_rows(residual) if residual is not None else x3  # x3 stands in when there is no residual
    if r3 is None or r3.stride(-1) != 1:
        r3 = _fold_rows(residual.contiguous())  # the wrapper does not require a contiguous residual
    o3, ro3 = _fold_rows(out), _fold_rows(residual_out)  # empty_like keeps x's strides or is contiguous
    hidden = x.shape[-1]
    num_rows = x.numel() // hidden
    block = triton.next_power_of_2(hidden)
    rows_per_program = max(1, _ELEMENTS_PER_PROGRAM // block)
    _rms_norm_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        x3, r3, weight.contiguous(), o3, ro3,
        num_rows, x3.shape[1],
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        o3.stride(0), o3.stride(1), ro3.stride(0), ro3.stride(1),
        eps,
        HIDDEN=hidden, BLOCK=block, ROWS=rows_per_program, ADD_RESIDUAL=residual is not None,
        num_warps=min(16, max(4, rows_per_program * block // 1024)),
    )
    return outs


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kiln::rms_norm on CUDA. x: [..., H] (last dim contiguous); weight: [H] -> [..., H]."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """kiln::fused_add_rms_norm on CUDA: returns (rms_norm(x + residual), x + residual)."""
    normed, summed = _launch(x, residual, weight, eps)
    return normed, summed
