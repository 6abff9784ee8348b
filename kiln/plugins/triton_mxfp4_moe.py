"""Triton kernels behind kiln::fused_moe_mxfp4 on CUDA: triton_moe.py's grouped GEMMs over expert-sorted tokens,
with each weight tile read as MXFP4 and decoded in registers.

The tokens' slots are grouped by expert exactly as for the float experts (triton_moe.align_by_expert), and the
two kernels are that module's gate/up and down kernels but for the weight loads: a [BLOCK_K, BLOCK_N] tile of
W^T reads, for weight row n and input column k, byte k // 2 of row n (the low nibble for even k) and scale
k // 32 of row n, and decodes

    E2M1 code c (sign bit 8; exponent e = (c >> 1) & 3, mantissa m = c & 1):
        |v| = m / 2 for e = 0 (0, 0.5), else (2 + m) * 2 ** (e - 2) (1, 1.5, 2, 3, 4, 6)
    E8M0 scale s: 2 ** (s - 127), made from its float32 bits (s << 23; s = 0 is the subnormal 2 ** -127)

in float32, exactly, then rounds the product to x's dtype (exact in bfloat16 and float32) as the reference's
dequantized weight is: the GEMM operands are the reference's, bit for bit. The weight streams at 4.25 bits
a value instead of 16, which is what bounds a decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_moe import _down_epilogue, _gate_up_epilogue, plan_experts
from .triton_mxfp4_pairs import pairs_down_kernel, pairs_gate_up_kernel


@triton.jit
def _mxfp4_tile(blocks_ptr, scales_ptr, rows, ks, row_ok, k_ok, stride_bn, stride_sn, dtype: tl.constexpr):
    """W^T tile [BK, BN] in `dtype`: rows [BN] of one expert's weight (its blocks viewed [N, K / 2] bytes, its
    scales [N, K / 32]), input columns ks [BK]."""
    mask = k_ok[:, None] & row_ok[None, :]
    byte = tl.load(blocks_ptr + rows[None, :].to(tl.int64) * stride_bn + (ks // 2)[:, None], mask=mask,
                   other=0).to(tl.int32)  # [BK, BN]
    code = (byte >> ((ks % 2) * 4)[:, None]) & 0xF
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    power = ((e + 125) << 23).to(tl.float32, bitcast=True)  # 2 ** (e - 2), from its float32 bits
    magnitude = tl.where(e == 0, m * 0.5, (2.0 + m) * power)
    value = tl.where(code >= 8, -magnitude, magnitude)
    s = tl.load(scales_ptr + rows[None, :].to(tl.int64) * stride_sn + (ks // 32)[:, None], mask=mask,
                other=127).to(tl.int32)  # [BK, BN]
    scale = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
    return (value * scale).to(dtype)


# Decoding a weight tile in registers, not reading it, bounds these kernels: narrower tiles decode less per
# program and spread the work over more programs. H200, GPT-OSS-20B's experts (E 32, H = I = 2880, top 4), both
# kernels, (BLOCK_M, BLOCK_N, BLOCK_K) = (16, N, 128): at 1 token N = 64: 1.52 ms, 32: 0.74, 16: 0.37; at 16
# tokens 8.06 / 4.68 / 2.11 ms (the float kernel: 0.34 / 0.54 ms at N = 64, where it is fastest).
MXFP4_BLOCK_N = 16

# Which kernels run: "tiles" (the two above, measured: GPT-OSS-20B 107 decode tok/s on an H200) or "pairs"
# (triton_mxfp4_pairs.py: each byte decoded once, in integer bits, with weight rows as the MMA's M side; checked
# under Triton's interpreter, not yet timed on a GPU). scripts/bench_mxfp4_moe.py times both; the winner stays.
KERNELS = "tiles"
# The pairs kernels' tile: BLOCK_N weight rows a program (the MMA's M), BLOCK_K inputs a step (BLOCK_K / 32
# scale groups); BLOCK_M comes from the expert plan as for the float kernels.
PAIRS_LAUNCH = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)


# Token counts change every step: specializing on them would only add recompiles.
@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_kernel(
    x_ptr, blocks_ptr, scales_ptr, h_ptr, sorted_slots_ptr, block_experts_ptr, b_ptr,
    num_slots, top_k, hidden, inter,
    stride_x, stride_be_blocks, stride_bn, stride_se, stride_sn, stride_h, stride_be, limit, alpha,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,
):
    # x: [T, H]; blocks: [E, 2I, H / 2] bytes, scales [E, 2I, H / 32] (gate rows, then up rows); h: [S, I]
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    dtype = h_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    slots = tl.load(sorted_slots_ptr + rows)  # [BM]; num_slots marks padding
    valid = slots < num_slots
    tokens = (slots // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of the I features
    col_ok = cols < inter
    e64 = expert.to(tl.int64)
    w_blocks, w_scales = blocks_ptr + e64 * stride_be_blocks, scales_ptr + e64 * stride_se
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        w_gate = _mxfp4_tile(w_blocks, w_scales, cols, ks, col_ok, k_ok, stride_bn, stride_sn, dtype)  # [BK, BN]
        w_up = _mxfp4_tile(w_blocks, w_scales, cols + inter, ks, col_ok, k_ok, stride_bn, stride_sn, dtype)
        acc_gate = tl.dot(a, w_gate, acc_gate)
        acc_up = tl.dot(a, w_up, acc_up)
    h = _gate_up_epilogue(acc_gate, acc_up, b_ptr + e64 * stride_be, cols, col_ok, inter, limit, alpha, dtype,
                          HAS_BIAS, CLAMPED)  # b: [E, 2I]
    tl.store(h_ptr + slots[:, None].to(tl.int64) * stride_h + cols[None, :], h,
             mask=valid[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def _down_kernel(
    h_ptr, blocks_ptr, scales_ptr, y_ptr, routing_ptr, sorted_slots_ptr, block_experts_ptr, b_ptr,
    num_slots, hidden, inter,
    stride_h, stride_be_blocks, stride_bn, stride_se, stride_sn, stride_y, stride_be,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    # h: [S, I]; blocks: [E, H, I / 2] bytes, scales [E, H, I / 32]; y: [S, H]; routing: [S] in x's dtype
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    dtype = y_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)  # [BM]
    valid = slots < num_slots
    slots64 = slots.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of the H outputs
    col_ok = cols < hidden
    e64 = expert.to(tl.int64)
    w_blocks, w_scales = blocks_ptr + e64 * stride_be_blocks, scales_ptr + e64 * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_ptr + slots64[:, None] * stride_h + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        w = _mxfp4_tile(w_blocks, w_scales, cols, ks, col_ok, k_ok, stride_bn, stride_sn, dtype)  # [BK, BN]
        acc = tl.dot(a, w, acc)
    y = _down_epilogue(acc, routing_ptr, slots, valid, b_ptr + e64 * stride_be, cols, col_ok, dtype,
                       HAS_BIAS)  # b: [E, H]
    tl.store(y_ptr + slots64[:, None] * stride_y + cols[None, :], y, mask=valid[:, None] & col_ok[None, :])


def fused_moe_mxfp4_triton(x: torch.Tensor, router_logits: torch.Tensor, gate_up_blocks: torch.Tensor,
                           gate_up_scales: torch.Tensor, down_blocks: torch.Tensor, down_scales: torch.Tensor,
                           top_k: int, renormalize: bool, b_gate_up: torch.Tensor | None = None,
                           b_down: torch.Tensor | None = None, swiglu_limit: float = 0.0,
                           swiglu_alpha: float = 0.0) -> torch.Tensor:
    """kiln::fused_moe_mxfp4 on CUDA (arguments as mxfp4_moe.fused_moe_mxfp4 checks them: blocks and scales
    contiguous) -> [T, H] in x's dtype."""
    num_tokens, hidden = x.shape
    num_experts, two_inter = gate_up_blocks.shape[:2]
    inter = two_inter // 2
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    plan = plan_experts(x, router_logits, top_k, renormalize, num_experts)
    weights, sorted_slots, block_experts, launch = plan.weights, plan.sorted_slots, plan.block_experts, plan.launch
    num_blocks = block_experts.numel()
    gu_blocks = gate_up_blocks.view(num_experts, two_inter, hidden // 2)  # [E, 2I, H / 2] bytes
    d_blocks = down_blocks.view(num_experts, hidden, inter // 2)  # [E, H, I / 2] bytes
    h = x.new_empty((num_slots, inter))  # [S, I]: every slot's row is written once
    y = x.new_empty((num_slots, hidden))  # [S, H]
    # Without biases the kernels never read their pointer (HAS_BIAS is compile-time): x stands in.
    b_gate_up_arg, b_down_arg = (x if b is None else b for b in (b_gate_up, b_down))
    if KERNELS == "pairs":
        cfg = dict(PAIRS_LAUNCH)
        block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
        gate_up_kernel, down_kernel, launch = pairs_gate_up_kernel, pairs_down_kernel, cfg
    else:
        block_n, block_k = MXFP4_BLOCK_N, plan.block_k
        gate_up_kernel, down_kernel = _gate_up_kernel, _down_kernel
    gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, gu_blocks, gate_up_scales, h, sorted_slots, block_experts, b_gate_up_arg,
        num_slots, top_k, hidden, inter,
        x.stride(0), gu_blocks.stride(0), gu_blocks.stride(1), gate_up_scales.stride(0), gate_up_scales.stride(1),
        h.stride(0), b_gate_up_arg.stride(0), float(swiglu_limit), float(swiglu_alpha),
        BLOCK_M=plan.block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=b_gate_up is not None,
        CLAMPED=swiglu_limit > 0, **launch)
    down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, d_blocks, down_scales, y, weights.reshape(-1), sorted_slots, block_experts, b_down_arg,
        num_slots, hidden, inter,
        h.stride(0), d_blocks.stride(0), d_blocks.stride(1), down_scales.stride(0), down_scales.stride(1),
        y.stride(0), b_down_arg.stride(0),
        BLOCK_M=plan.block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=b_down is not None, **launch)
    return y.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
