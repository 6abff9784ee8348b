"""MXFP4 expert kernels that decode each weight byte once, in integer bits ("pairs" layout of the work).

The same grouped GEMMs as triton_mxfp4_moe.py's first kernels (expert-sorted slots, gate/up then down, the
shared epilogues), with the weight side arranged for decoding, which is what bounds GPT-OSS's experts:

- **weight-stationary, swapped operands**: a program computes out^T [BN, BM] = W [BN, K] @ x^T [K, BM], the
  weight rows the MMA's M side (BN = 32..128 rows) and the expert block's BM tokens its N side, so the decoded
  tile goes into tl.dot as it is laid out in memory (rows of K), with no transpose;
- **each byte read once, both nibbles used**: a row's bytes for the tile are loaded as [BN, G, 16] (G groups of
  32 values; vectorized, contiguous along K) with the group's E8M0 scale as [BN, G, 1], broadcast, never
  gathered per element. The low nibbles are the even inputs k0 + 2j, the high ones the odd inputs k0 + 2j + 1,
  so the activations are read as two strided halves and the product is two dots over BK / 2 each;
- **decoding in the exponent bits** (float32 bits, then one conversion to x's dtype), about eight integer ops a
  value instead of a float select chain and a multiply:

      code c = sign (bit 3) | e (bits 1-2) | m (bit 0); scale s; S = (s - 1) << 23
      c & 7 >= 2:  (c & 7) << 22 puts e and m in float32's exponent and top mantissa bit; + S makes the
                   exponent e + s - 1, i.e. the value 2 ** (e - 1) * (1 + m / 2) * 2 ** (s - 127)
      c & 7 == 1:  S alone is 2 ** (s - 128) = 0.5 * 2 ** (s - 127); c & 7 == 0: 0
      sign: (c & 8) << 28 is float32's sign bit

  exact, as the reference's float32 product is, for scales s in [2, 252] (2 ** -125 .. 2 ** 125; checkpoints'
  scales sit near 2 ** -10 .. 2 ** 2). Below that the kernel flushes the block's values under 2 ** -124 to
  zero or near it; above, the largest codes overflow to inf or NaN where the reference's are inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_moe import _down_epilogue, _gate_up_epilogue


@triton.jit
def _e2m1_times_scale(code, scale_bits):
    """code: 4-bit E2M1 codes (int32, any shape); scale_bits: (s - 1) << 23 broadcastable to it -> float32."""
    c7 = code & 7
    magnitude = tl.where(c7 >= 2, (c7 << 22) + scale_bits, c7 * scale_bits)
    return (magnitude | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _weight_pairs(blocks_ptr, scales_ptr, rows, row_ok, k0, num_groups, stride_bn, stride_sn, dtype: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [BN] of one expert's MXFP4 weight (blocks viewed [N, K / 2] bytes, scales [N, K / 32]) at inputs
    k0 .. k0 + BK -> (even, odd): [BN, BK / 2] each in `dtype`, the weights of inputs k0 + 2j and k0 + 2j + 1."""
    G: tl.constexpr = BLOCK_K // 32
    groups = k0 // 32 + tl.arange(0, G)  # [G]
    ok = row_ok[:, None, None] & (groups < num_groups)[None, :, None]  # [BN, G, 1]
    rows64 = rows.to(tl.int64)[:, None, None]
    byte = tl.load(blocks_ptr + rows64 * stride_bn + (groups * 16)[None, :, None] + tl.arange(0, 16)[None, None, :],
                   mask=ok, other=0).to(tl.int32)  # [BN, G, 16]
    s = tl.load(scales_ptr + rows64 * stride_sn + groups[None, :, None], mask=ok, other=127).to(tl.int32)
    scale_bits = tl.maximum(s - 1, 0) << 23  # [BN, G, 1]
    even = _e2m1_times_scale(byte & 15, scale_bits)
    odd = _e2m1_times_scale(byte >> 4, scale_bits)
    return (tl.reshape(even, (BLOCK_N, BLOCK_K // 2)).to(dtype),
            tl.reshape(odd, (BLOCK_N, BLOCK_K // 2)).to(dtype))


@triton.jit
def _activation_pairs(base_ptrs, ok, k0, num_k, BLOCK_K: tl.constexpr):
    """x^T halves for inputs k0 .. k0 + BK: base_ptrs [1, BM] (each row's start), ok [1, BM] -> (even, odd)
    [BK / 2, BM], the inputs k0 + 2j and k0 + 2j + 1."""
    ks = k0 + 2 * tl.arange(0, BLOCK_K // 2)  # [BK / 2]
    even = tl.load(base_ptrs + ks[:, None], mask=ok & (ks < num_k)[:, None], other=0.0)
    odd = tl.load(base_ptrs + ks[:, None] + 1, mask=ok & (ks + 1 < num_k)[:, None], other=0.0)
    return even, odd


# Token counts change every step: specializing on them would only add recompiles.
@triton.jit(do_not_specialize=["num_slots"])
def pairs_gate_up_kernel(
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
    places = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    slots = tl.load(sorted_slots_ptr + places)  # [BM]; num_slots marks padding
    valid = slots < num_slots
    tokens = (slots // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of the I features
    col_ok = cols < inter
    e64 = expert.to(tl.int64)
    w_blocks, w_scales = blocks_ptr + e64 * stride_be_blocks, scales_ptr + e64 * stride_se
    x_rows = x_ptr + tokens[None, :] * stride_x  # [1, BM]
    acc_gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # transposed: [BN, BM]
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    num_groups = hidden // 32
    for k0 in range(0, hidden, BLOCK_K):
        a_even, a_odd = _activation_pairs(x_rows, valid[None, :], k0, hidden, BLOCK_K)  # [BK / 2, BM] each
        g_even, g_odd = _weight_pairs(w_blocks, w_scales, cols, col_ok, k0, num_groups, stride_bn, stride_sn,
                                      dtype, BLOCK_N, BLOCK_K)  # [BN, BK / 2] each
        acc_gate = tl.dot(g_odd, a_odd, tl.dot(g_even, a_even, acc_gate))
        u_even, u_odd = _weight_pairs(w_blocks, w_scales, cols + inter, col_ok, k0, num_groups, stride_bn,
                                      stride_sn, dtype, BLOCK_N, BLOCK_K)
        acc_up = tl.dot(u_odd, a_odd, tl.dot(u_even, a_even, acc_up))
    h = _gate_up_epilogue(tl.trans(acc_gate), tl.trans(acc_up), b_ptr + e64 * stride_be, cols, col_ok, inter, limit,
                          alpha, dtype, HAS_BIAS, CLAMPED)  # [BM, BN]; b: [E, 2I]
    tl.store(h_ptr + slots[:, None].to(tl.int64) * stride_h + cols[None, :], h,
             mask=valid[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def pairs_down_kernel(
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
    places = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + places)  # [BM]
    valid = slots < num_slots
    slots64 = slots.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of the H outputs
    col_ok = cols < hidden
    e64 = expert.to(tl.int64)
    w_blocks, w_scales = blocks_ptr + e64 * stride_be_blocks, scales_ptr + e64 * stride_se
    h_rows = h_ptr + slots64[None, :] * stride_h  # [1, BM]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # transposed: [BN, BM]
    num_groups = inter // 32
    for k0 in range(0, inter, BLOCK_K):
        a_even, a_odd = _activation_pairs(h_rows, valid[None, :], k0, inter, BLOCK_K)  # [BK / 2, BM] each
        w_even, w_odd = _weight_pairs(w_blocks, w_scales, cols, col_ok, k0, num_groups, stride_bn, stride_sn,
                                      dtype, BLOCK_N, BLOCK_K)  # [BN, BK / 2] each
        acc = tl.dot(w_odd, a_odd, tl.dot(w_even, a_even, acc))
    y = _down_epilogue(tl.trans(acc), routing_ptr, slots, valid, b_ptr + e64 * stride_be, cols, col_ok, dtype,
                       HAS_BIAS)  # [BM, BN]; b: [E, H]
    tl.store(y_ptr + slots64[:, None] * stride_y + cols[None, :], y, mask=valid[:, None] & col_ok[None, :])
