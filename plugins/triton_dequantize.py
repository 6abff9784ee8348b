"""Triton kernel that dequantizes a weight-only quantized weight (INT4 / INT8, group scales, optional zero
points and act-order g_idx) into x's dtype, for prefill-sized W4A16 / W8A16 products that then run as one
cuBLAS GEMM: past a few dozen tokens a GEMM is compute-bound, where cuBLAS's tensor-core kernels beat a
Triton GEMM that dequantizes each tile in its inner loop, and writing the dense weight once costs less than
the difference.

Values are the reference's (quant_linear._dequantize) bit for bit: u - zero point (or - 8 for symmetric INT4,
nothing for signed INT8) in float32, times the group's float32 scale, one rounding to the dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_N = 16  # weight rows per program
_BLOCK_K = 256  # weight columns per program


@triton.jit
def _dequantize_kernel(qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr, N, K, group_size,
                       stride_qn, stride_sn, stride_sg, stride_zn, stride_zg, stride_gk, stride_on,
                       BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of N
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K] of K
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    if BITS == 4:  # column k sits in byte k // 2: the low nibble for an even k, the high one for an odd k
        packed = tl.load(qw_ptr + rows64 * stride_qn + (cols // 2)[None, :], mask=mask, other=0)
        u = (packed.to(tl.int32) >> ((cols % 2) * 4)[None, :]) & 0xF
    else:
        u = tl.load(qw_ptr + rows64 * stride_qn + cols[None, :], mask=mask, other=0)
    if HAS_G_IDX:
        groups = tl.load(g_idx_ptr + cols * stride_gk, mask=cols < K, other=0)  # [BLOCK_K]
    else:
        groups = cols // group_size
    s = tl.load(scales_ptr + rows64 * stride_sn + groups[None, :] * stride_sg, mask=mask, other=0.0)
    q = u.to(tl.float32)
    if HAS_ZEROS:
        q = q - tl.load(zeros_ptr + rows64 * stride_zn + groups[None, :] * stride_zg, mask=mask,
                        other=0).to(tl.float32)
    elif BITS == 4:
        q = q - 8.0  # symmetric INT4 stores q + 8
    tl.store(out_ptr + rows64 * stride_on + cols[None, :], (q * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_weight_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                             group_size: int, dtype: torch.dtype, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """quant_linear.dequantize_weight on CUDA (arguments as checked there): -> [N, K] in `dtype`."""
    n = qweight.shape[0]
    k = qweight.shape[1] * (8 // bits)
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(n, _BLOCK_N), triton.cdiv(k, _BLOCK_K))
    # Unused pointer arguments get any tensor: their loads are compiled out by the constexpr flags.
    _dequantize_kernel[grid](
        qweight, scales, scales if zeros is None else zeros, scales if g_idx is None else g_idx, out,
        n, k, group_size, qweight.stride(0), *scales.stride(),
        *(zeros.stride() if zeros is not None else (0, 0)), 0 if g_idx is None else g_idx.stride(0), out.stride(0),
        BITS=bits, HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None,
        BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4)
    return out
