"""Triton kernels behind kiln::rms_norm_quant, kiln::fused_add_rms_norm_quant and kiln::silu_and_mul_quant on
CUDA (semantics: norm_quant.py).

Each computes its float operator as triton_norm.py / triton_activation.py do, rounding every step to x's
dtype where the reference does, and keeps the result in registers as float32 holding values of x's dtype;
instead of storing it, it quantizes it as triton_scaled_linear's activation quantization does (`_to_cache`:
IEEE division by the scale, saturation at +-448, rounding half to even on the e4m3 grid), the dynamic scale
being the row's amax / 448 by IEEE division, floored at MIN_DYNAMIC_SCALE. Every program also stores its
rows' scales, the static one included. FMA contraction is off: each float32 op rounds as torch's do.

As with triton_norm, the sum of squares is added in another order than torch's reduction, so a normalized
value can, rarely, be an ulp off the reference's (and then its FP8 byte a step off, or a dynamic scale an ulp
of x's dtype / 448 off when that value is the row's amax); the rest matches bit for bit. SiLU-and-mul matches
bit for bit (libdevice's expf, as torch's CUDA silu).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_limits import FP8_MAX, MIN_DYNAMIC_SCALE
from .triton_activation import _exp
from .triton_norm import _ELEMENTS_PER_PROGRAM
from .triton_rotary_kv import _to_cache

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_DYNAMIC_SCALE)
_SILU_BLOCK = 1024  # columns per program of a static-scale SiLU-and-mul (triton_activation's block)
_MAX_SILU_ROW_BLOCK = 4096  # columns a dynamic-scale program (one a row) holds at once; longer rows loop


@triton.jit
def _row_scale(y, scale_ptr, DYNAMIC: tl.constexpr):
    """y: [ROWS, BLOCK] float32 (0 where masked) -> [ROWS] float32: amax / 448 floored (DYNAMIC), else the
    static [1] scale read on the device (no host sync) for every row."""
    if DYNAMIC:
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=1), _FP8_MAX), _MIN_SCALE)
    else:
        scale = tl.load(scale_ptr + tl.zeros((y.shape[0],), dtype=tl.int32))
    return scale


# Row counts change every step: specializing on them would only add recompiles.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_quant_kernel(
    x_ptr, residual_ptr, weight_ptr, scale_ptr, xq_ptr, sx_ptr, residual_out_ptr,
    num_rows, stride_x, stride_r, stride_q, stride_ro, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    DYNAMIC: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    row_ok = rows < num_rows
    starts = rows.to(tl.int64)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = row_ok[:, None] & (cols < HIDDEN)  # [ROWS, BLOCK]
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + starts * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + starts * stride_r + cols, mask=mask, other=0.0)
        # The reference normalizes x + residual as rounded to the input dtype, and returns that sum.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + starts * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    # torch's CUDA mean multiplies the sum by 1/H rather than dividing by H; so do we (triton_norm.py).
    variance = tl.sum(xf * xf, axis=1) * (1.0 / HIDDEN)  # [ROWS]
    normed = (xf * tl.math.rsqrt(variance + eps)[:, None]).to(dtype)
    weight = tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0)
    # The norm's output as the reference returns it (one rounding of an exact product), then quantized.
    y = (weight.to(tl.float32) * normed.to(tl.float32)).to(dtype).to(tl.float32)  # [ROWS, BLOCK]
    scale = _row_scale(y, scale_ptr, DYNAMIC)  # [ROWS]
    tl.store(xq_ptr + starts * stride_q + cols, _to_cache(y, scale[:, None], xq_ptr, True), mask=mask)
    tl.store(sx_ptr + rows, scale, mask=row_ok)


@triton.jit
def _silu_and_mul_row(x_row, cols, inter):
    """cols: [BLOCK] of a row's I outputs -> [1, BLOCK] float32 silu(gate) * up as the reference rounds it
    (silu rounded to x's dtype, then the product); 0 past inter."""
    cols = cols[None, :]
    mask = cols < inter
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_row.dtype.element_ty
    # div_rn: Triton's `/` on float32 is an approximate division; torch's is IEEE.
    silu = tl.math.div_rn(gate, 1.0 + _exp(-gate)).to(dtype)
    return (silu.to(tl.float32) * up).to(dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, scale_ptr, xq_ptr, sx_ptr, inter, stride_x, stride_q,
                               DYNAMIC: tl.constexpr, BLOCK: tl.constexpr):
    """Row = program 0. DYNAMIC: one program a row, two passes over it (the row's amax, then the values
    again, quantized); static: program 1 picks a block of BLOCK columns, the first one stores the scale."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = xq_ptr + row * stride_q
    offs = tl.arange(0, BLOCK)
    if DYNAMIC:
        amax = tl.zeros((1,), dtype=tl.float32)
        for c0 in range(0, inter, BLOCK):
            amax = tl.maximum(amax, tl.max(tl.abs(_silu_and_mul_row(x_row, c0 + offs, inter)), axis=1))
        scale = tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _MIN_SCALE)  # [1]
        for c0 in range(0, inter, BLOCK):
            cols = (c0 + offs)[None, :]
            y = _silu_and_mul_row(x_row, c0 + offs, inter)
            tl.store(q_row + cols, _to_cache(y, scale[:, None], xq_ptr, True), mask=cols < inter)
        tl.store(sx_ptr + row + tl.arange(0, 1), scale)
    else:
        cols = (tl.program_id(1) * BLOCK + offs)[None, :]
        y = _silu_and_mul_row(x_row, tl.program_id(1) * BLOCK + offs, inter)
        scale = tl.load(scale_ptr + tl.zeros((1,), dtype=tl.int32))  # [1]
        tl.store(q_row + cols, _to_cache(y, scale[:, None], xq_ptr, True), mask=cols < inter)
        if tl.program_id(1) == 0:
            tl.store(sx_ptr + row + tl.arange(0, 1), scale)


def _quantized_outputs(x: torch.Tensor, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((x.shape[0], features), dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device))


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 input_scale: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    tokens, hidden = x.shape
    x_q, x_scale = _quantized_outputs(x, hidden)
    residual_out = torch.empty_like(x) if residual is not None else x_q  # the strides the fake promises
    outs = (x_q, x_scale, residual_out) if residual is not None else (x_q, x_scale)
    if tokens == 0:
        return outs
    block = triton.next_power_of_2(hidden)
    rows_per_program = max(1, _ELEMENTS_PER_PROGRAM // block)
    # Unused pointers get any tensor: their loads and stores are compiled out by the constexpr flags.
    r = x if residual is None else residual
    _rms_norm_quant_kernel[(triton.cdiv(tokens, rows_per_program),)](
        x, r, weight.contiguous(), x_scale if input_scale is None else input_scale, x_q, x_scale, residual_out,
        tokens, x.stride(0), r.stride(0), x_q.stride(0), residual_out.stride(0), eps,
        HIDDEN=hidden, BLOCK=block, ROWS=rows_per_program, ADD_RESIDUAL=residual is not None,
        DYNAMIC=input_scale is None,
        num_warps=min(16, max(4, rows_per_program * block // 1024)), enable_fp_fusion=False,
    )
    return outs


def rms_norm_quant_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                          input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """kiln::rms_norm_quant on CUDA. x: [T, H] (last dim contiguous); weight: [H]; input_scale: [1] float32
    or None -> (x_q [T, H] float8_e4m3fn, x_scale [T, 1] float32)."""
    x_q, x_scale = _launch_norm(x, None, weight, eps, input_scale)
    return x_q, x_scale


def fused_add_rms_norm_quant_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                    input_scale: torch.Tensor | None
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kiln::fused_add_rms_norm_quant on CUDA: (x_q, x_scale) of rms_norm(x + residual), and x + residual."""
    x_q, x_scale, summed = _launch_norm(x, residual, weight, eps, input_scale)
    return x_q, x_scale, summed


def silu_and_mul_quant_triton(x: torch.Tensor,
                              input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """kiln::silu_and_mul_quant on CUDA. x: [T, 2I] = [gate | up] (last dim contiguous); input_scale: [1]
    float32 or None -> (x_q [T, I] float8_e4m3fn, x_scale [T, 1] float32)."""
    tokens, inter = x.shape[0], x.shape[1] // 2
    x_q, x_scale = _quantized_outputs(x, inter)
    if tokens == 0:
        return x_q, x_scale
    if input_scale is None:
        block = min(triton.next_power_of_2(inter), _MAX_SILU_ROW_BLOCK)
        grid = (tokens, 1)
    else:
        block = _SILU_BLOCK
        grid = (tokens, triton.cdiv(inter, block))
    _silu_and_mul_quant_kernel[grid](
        x, x_scale if input_scale is None else input_scale, x_q, x_scale, inter, x.stride(0), x_q.stride(0),
        DYNAMIC=input_scale is None, BLOCK=block, num_warps=max(4, min(8, block // 512)),
        enable_fp_fusion=False,
    )
    return x_q, x_scale
