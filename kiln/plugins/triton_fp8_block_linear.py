"""Triton kernels behind `kiln::fp8_block_linear` on CUDA (semantics: plugins/fp8_block_linear.py).

Two launches, as DeepSeek's and vLLM's `w8a8_block_fp8_matmul`:
1. the activations are quantized per token and per group of b1 input columns by
   `quantize_activations_triton` (triton_scaled_linear.py), bit-equal to quantize_activation_groups:
   x_q [T, G * b1] float8_e4m3fn (a ragged last group padded with zeros), s_x [T, G] float32;
2. `_block_mm_kernel` walks K one group at a time: each group's FP8 dot is a fresh float32 partial sum
   (exact products; the tensor cores' short accumulator never spans more than b1 columns), multiplied by
   s_x[t, g] and then by the weight block's scale weight_scale_inv[n // b0, g] and added to a float32
   accumulator, as the reference does (FMA contraction off, so each op rounds as torch's). The bias is added
   last and the output rounded once. Only the summation order inside a group differs from the reference.

Launch settings come from shapes only and the scales stay on the device: CUDA graphs capture the op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import sm_count as _sm_count
from .triton_scaled_linear import gemm_config, quantize_activations_triton


@triton.jit(do_not_specialize=["T"])
def _block_mm_kernel(a_ptr, w_ptr, sx_ptr, ws_ptr, bias_ptr, out_ptr, T, N, K, groups, group_k, group_n,
                     stride_at, stride_st, stride_wn, stride_ws_n, stride_ws_k, stride_ot,
                     HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of y = sum over groups g of (x_q[:, g] @ W[:, g]^T) * s_x[:, g] * w_s[:, g]
    (w_s[n, g] = weight_scale_inv[n // b0, g]). BLOCK_K >= group_k (b1); EVEN: BLOCK_K == b1 and b1 divides K,
    so no column is masked."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] tokens
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    # Rows and columns past the edge read a valid one (modulo): loads stay unmasked along M and N.
    a_rows = (rows % T).to(tl.int64)
    w_rows = (cols % N).to(tl.int64)
    ws_rows = w_rows // group_n  # [BLOCK_N] each column's row of weight blocks
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, groups):
        ks = g * group_k + offs_k  # [BLOCK_K] input features of group g (and past it when BLOCK_K > b1)
        a_offs = a_rows[:, None] * stride_at + ks[None, :]  # [BLOCK_M, BLOCK_K]; x_q rows hold G * b1
        w_offs = w_rows[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
        if EVEN:
            a = tl.load(a_ptr + a_offs)
            w = tl.load(w_ptr + w_offs)
        else:  # x_q's padding is zeros already; W stops at K; a group narrower than BLOCK_K stops at b1
            in_group = (offs_k < group_k)[None, :]
            a = tl.load(a_ptr + a_offs, mask=in_group, other=0.0)
            w = tl.load(w_ptr + w_offs, mask=in_group & (ks < K)[None, :], other=0.0)
        partial = tl.dot(a, tl.trans(w))  # [BLOCK_M, BLOCK_N] float32
        s_x = tl.load(sx_ptr + a_rows * stride_st + g)  # [BLOCK_M]
        w_scale = tl.load(ws_ptr + ws_rows * stride_ws_n + g * stride_ws_k)  # [BLOCK_N]
        acc += partial * s_x[:, None] * w_scale[None, :]  # the reference's (partial * s_x) * w_s
    if HAS_BIAS:
        acc += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
    out_mask = (rows < T)[:, None] & (cols < N)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def fp8_block_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                            block_size: list[int], bias: torch.Tensor | None) -> torch.Tensor:
    """kiln::fp8_block_linear on CUDA. x: [T, K] float; weight: [N, K] float8_e4m3fn, contiguous;
    weight_scale_inv: [ceil(N / b0), ceil(K / b1)] float32; block_size: [b0, b1]; bias: [N] x.dtype
    -> [T, N] x.dtype. Arguments as checked by fp8_block_linear.fp8_block_linear."""
    b0, b1 = block_size
    t, k = x.shape
    n = weight.shape[0]
    out = x.new_empty((t, n))
    if out.numel() == 0:
        return out
    x_q, s_x = quantize_activations_triton(x, torch.float8_e4m3fn, b1)  # [T, G * b1], [T, G]
    groups = s_x.shape[1]
    block_k = max(16, triton.next_power_of_2(b1))  # tl.dot needs K >= 16; 128 for every known checkpoint
    cfg = gemm_config(t, n, _sm_count(x.device))
    grid = (triton.cdiv(t, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _block_mm_kernel[grid](
        x_q, weight, s_x, weight_scale_inv, x if bias is None else bias.contiguous(), out,
        t, n, k, groups, b1, b0,
        x_q.stride(0), s_x.stride(0), weight.stride(0), *weight_scale_inv.stride(), out.stride(0),
        HAS_BIAS=bias is not None, EVEN=block_k == b1 and k % b1 == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        # A fused multiply-add would skip a rounding of the reference's (partial * s_x) * w_s + acc.
        enable_fp_fusion=False)
    return out
