"""Triton kernel behind kiln::silu_and_mul on CUDA.

It computes what the reference's torch ops compute on CUDA: F.silu as x / (1 + expf(-x)) in float32 rounded
to the dtype, then the product with `up` rounded to the dtype, so outputs match the reference bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# libdevice's expf is the exp torch's CUDA silu calls; tl.exp is a faster approximation a few ulp away.
# Triton's interpreter (TRITON_INTERPRET=1, which checks this kernel's logic on CPU) has no libdevice.
if os.environ.get("TRITON_INTERPRET") == "1":
    @triton.jit
    def _exp(x):
        return tl.exp(x)
else:
    _exp = libdevice.exp

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] of the I outputs
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # div_rn: Triton's `/` on float32 is an approximate division; torch's is IEEE.
    silu = tl.math.div_rn(gate, 1.0 + _exp(-gate)).to(dtype)
    tl.store(out_ptr + row * stride_out + cols, (silu.to(tl.float32) * up).to(dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """kiln::silu_and_mul on CUDA. x: [T, 2*I] = [gate | up] (last dim contiguous) -> [T, I]."""
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = x.new_empty((tokens, inter))
    if out.numel():
        grid = (tokens, triton.cdiv(inter, _BLOCK))
        _silu_and_mul_kernel[grid](x, out, inter, x.stride(0), out.stride(0), BLOCK=_BLOCK, num_warps=4)
    return out
