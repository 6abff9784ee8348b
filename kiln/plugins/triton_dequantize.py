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
# INT4: one row of 1024 columns per program. H100, 28672 x 4096 to bfloat16: 166 us (1.8 TB/s of bytes read
# and written), 181 with 4 x 256, 315 with 16 x 256; 491 before the nibbles were split after a contiguous load.
_INT4_BLOCK_N = 1
_INT4_BLOCK_K = 1024


@triton.jit
def _scaled(u, rows64, cols, mask, scales_ptr, zeros_ptr, g_idx_ptr, K, group_size, stride_sn, stride_sg,
            stride_zn, stride_zg, stride_gk, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
            HAS_G_IDX: tl.constexpr):
    # u: [BLOCK_N, C] unsigned codes of weight columns `cols` ([C] of K) -> (u - zero point) * scale, float32
    if HAS_G_IDX:
        groups = tl.load(g_idx_ptr + cols * stride_gk, mask=cols < K, other=0)  # [C]
    else:
        groups = cols // group_size
    s = tl.load(scales_ptr + rows64 * stride_sn + groups[None, :] * stride_sg, mask=mask, other=0.0)
    q = u.to(tl.float32)
    if HAS_ZEROS:
        q = q - tl.load(zeros_ptr + rows64 * stride_zn + groups[None, :] * stride_zg, mask=mask,
                        other=0).to(tl.float32)
    elif BITS == 4:
        q = q - 8.0  # symmetric INT4 stores q + 8
    return q * s


@triton.jit
def _dequantize_kernel(qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr, N, K, group_size,
                       stride_qn, stride_sn, stride_sg, stride_zn, stride_zg, stride_gk, stride_on,
                       BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of N
    rows64 = rows.to(tl.int64)[:, None]
    if BITS == 4:
        # Byte j holds columns 2j (low nibble) and 2j + 1 (high nibble): the bytes load as one contiguous run,
        # each nibble's columns dequantize apart and interleave back into BLOCK_K contiguous columns to store
        # (loading byte k // 2 for every column k made byte-wide loads and stores, a quarter of the bandwidth).
        half = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)  # [BLOCK_K / 2] bytes
        even = half * 2
        mask = (rows < N)[:, None] & (even < K)[None, :]
        packed = tl.load(qw_ptr + rows64 * stride_qn + half[None, :], mask=mask, other=0).to(tl.int32)
        low = _scaled(packed & 0xF, rows64, even, mask, scales_ptr, zeros_ptr, g_idx_ptr, K, group_size,
                      stride_sn, stride_sg, stride_zn, stride_zg, stride_gk, BITS, HAS_ZEROS, HAS_G_IDX)
        high = _scaled((packed >> 4) & 0xF, rows64, even + 1, mask, scales_ptr, zeros_ptr, g_idx_ptr, K,
                       group_size, stride_sn, stride_sg, stride_zn, stride_zg, stride_gk, BITS, HAS_ZEROS,
                       HAS_G_IDX)
        w = tl.interleave(low, high)  # [BLOCK_N, BLOCK_K]: columns 2j, 2j + 1
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    else:
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K] of K
        in_bounds = (rows < N)[:, None] & (cols < K)[None, :]
        u = tl.load(qw_ptr + rows64 * stride_qn + cols[None, :], mask=in_bounds, other=0)
        w = _scaled(u, rows64, cols, in_bounds, scales_ptr, zeros_ptr, g_idx_ptr, K, group_size, stride_sn,
                    stride_sg, stride_zn, stride_zg, stride_gk, BITS, HAS_ZEROS, HAS_G_IDX)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    tl.store(out_ptr + rows64 * stride_on + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_weight_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                             group_size: int, dtype: torch.dtype, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """quant_linear.dequantize_weight on CUDA (arguments as checked there): -> [N, K] in `dtype`."""
    n = qweight.shape[0]
    k = qweight.shape[1] * (8 // bits)
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    if out.numel() == 0:
        return out
    block_n, block_k = (_INT4_BLOCK_N, _INT4_BLOCK_K) if bits == 4 else (_BLOCK_N, _BLOCK_K)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    # Unused pointer arguments get any tensor: their loads are compiled out by the constexpr flags.
    _dequantize_kernel[grid](
        qweight, scales, scales if zeros is None else zeros, scales if g_idx is None else g_idx, out,
        n, k, group_size, qweight.stride(0), *scales.stride(),
        *(zeros.stride() if zeros is not None else (0, 0)), 0 if g_idx is None else g_idx.stride(0), out.stride(0),
        BITS=bits, HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out
