"""AWQ / SmoothQuant smoothing of activations on CUDA: x * pre_quant_scale in float32, rounded to x's dtype, as
the references (plugins/quant_linear.py) smooth before their GEMM."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _smooth_kernel(x_ptr, pqs_ptr, out_ptr, T, K, stride_xm, stride_pp, stride_op, stride_om, BLOCK: tl.constexpr):
    """out[p, m, ks] = (x[m, ks] * pre_quant_scale[p, ks]) in float32, rounded to x's dtype: the reference's
    smoothing, for every part p (program rows p * T + m)."""
    p = (tl.program_id(0) // T).to(tl.int64)
    row = (tl.program_id(0) % T).to(tl.int64)
    ks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = ks < K
    x = tl.load(x_ptr + row * stride_xm + ks, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.load(pqs_ptr + p * stride_pp + ks, mask=mask, other=0.0)
    tl.store(out_ptr + p * stride_op + row * stride_om + ks, y.to(out_ptr.dtype.element_ty), mask=mask)


def smooth_triton(x: torch.Tensor, pre_quant_scale: torch.Tensor) -> torch.Tensor:
    """x: [T, K] (last dim contiguous) times pre_quant_scale: [K] float32 -> [T, K] in x's dtype, or times each
    row of pre_quant_scale: [P, K] -> [P, T, K] (the parts of weight_only_linear_parts).

    One pass over x before the GEMM rather than inside it: every output tile's program would smooth the same x
    again, which cost the decode GEMV 10-30% at the Llama-3.1-8B shapes on an H100 (x is 16 rows a tile there,
    the one real token repeated)."""
    t, k = x.shape
    pqs = pre_quant_scale.reshape(-1, k)
    if pqs.stride(-1) != 1:
        pqs = pqs.contiguous()
    out = torch.empty((pqs.shape[0], t, k), dtype=x.dtype, device=x.device)
    if t:
        block = 1024
        _smooth_kernel[(pqs.shape[0] * t, triton.cdiv(k, block))](
            x, pqs, out, t, k, x.stride(0), pqs.stride(0), out.stride(0), out.stride(1), BLOCK=block, num_warps=4)
    return out if pre_quant_scale.dim() == 2 else out[0]
