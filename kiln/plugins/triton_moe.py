"""Triton kernels behind kiln::fused_moe on CUDA: grouped GEMMs over expert-sorted tokens.

As the fused-MoE kernels of vLLM and SGLang do, each token's top-k (token, expert) slots are grouped by
expert and each expert's run is padded to a multiple of BLOCK_M, so one program's BLOCK_M rows all use one expert's
weights. Two kernels then run over those blocks:

- gate/up: h[slot] = silu(x[token] @ gate_e^T) * (x[token] @ up_e^T), gate and up accumulated side by side
  and combined in the epilogue (no [S, 2I] intermediate);
- down: y[slot] = (h[slot] @ down_e^T) * weight[slot].

and the k slots of each token are summed in float32. Every step that rounds in the reference (moe.py) rounds
here too: the GEMM outputs, silu, the product with up, the down output and its product with the routing
weight are each rounded to x's dtype, so what differs is only the order of the float32 sums (in the GEMMs,
and the final k-way sum that the reference adds in x's dtype).

GPT-OSS's experts (HAS_BIAS, CLAMPED) add their biases to the rounded GEMM outputs (gate/up before the
activation, down before the routing weight), each sum rounded, and take the clamped SwiGLU
(moe.expert_activation), computed in float32 from the rounded gate and up and rounded once (the reference
rounds after each of its ops: a few units in the last place apart).

Everything is sized by the number of tokens only, never by how they route: the grouping, the padding and the
grid (an upper bound on the number of blocks; blocks past the end exit at once) are device ops with no host
read, so an MoE step is captured in a CUDA graph like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .moe_route import route
from .triton_activation import _exp


# Token counts change every step: specializing on them would only add recompiles.
@triton.jit(do_not_specialize=["num_slots"])
def _count_kernel(ids_ptr, counts_ptr, rank_ptr, num_slots, CHUNK: tl.constexpr):
    """Counts each expert's slots; a slot's rank among its expert's slots is the count its atomic add saw.
    The ranks' order within an expert depends on timing, which changes no output: each slot's GEMM rows are
    its own, and a token's k slots are summed in slot order afterwards."""
    slots = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    ok = slots < num_slots
    e = tl.load(ids_ptr + slots, mask=ok, other=0).to(tl.int32)
    rank = tl.atomic_add(counts_ptr + e, 1, mask=ok)
    tl.store(rank_ptr + slots, rank, mask=ok)


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def _place_kernel(ids_ptr, counts_ptr, rank_ptr, sorted_slots_ptr, block_experts_ptr,
                  num_slots, num_experts, num_blocks,
                  BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr):
    """Lays the runs out (each expert's, padded to BLOCK_M, in expert order; every program recomputes the
    E-long prefix sum), then program p handles chunk p of the slots (each to its run start + rank), of the
    places (padding ones get num_slots) and of the blocks (each block's expert, -1 past the runs)."""
    experts = tl.arange(0, E_P2)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)  # [E_P2]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    # The power-of-two padding experts are no runs: they must not count as ending before a place.
    padded_end = tl.where(experts < num_experts, padded_end, 2147483647)
    lanes = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]

    slot_ok = lanes < num_slots
    e = tl.load(ids_ptr + lanes, mask=slot_ok, other=0).to(tl.int32)
    rank = tl.load(rank_ptr + lanes, mask=slot_ok, other=0)
    start = tl.sum(tl.where(e[:, None] == experts[None, :], padded_start[None, :], 0), axis=1)  # [CHUNK]
    tl.store(sorted_slots_ptr + start + rank, lanes, mask=slot_ok)

    # A place's expert: the number of runs that end at or before it (an empty run ends where the one before
    # does, so it is skipped); num_experts past the last run.
    place_expert = tl.sum((padded_end[None, :] <= lanes[:, None]).to(tl.int32), axis=1)  # [CHUNK]
    hit = place_expert[:, None] == experts[None, :]  # [CHUNK, E_P2]
    in_run = lanes - tl.sum(tl.where(hit, padded_start[None, :], 0), axis=1)
    pad = (place_expert >= num_experts) | (in_run >= tl.sum(tl.where(hit, counts[None, :], 0), axis=1))
    # Padding places only: the slots' own places are written above, so no place is written twice.
    tl.store(sorted_slots_ptr + lanes, num_slots + 0 * lanes, mask=(lanes < num_blocks * BLOCK_M) & pad)

    block_expert = tl.sum((padded_end[None, :] <= (lanes * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    tl.store(block_experts_ptr + lanes, tl.where(block_expert < num_experts, block_expert, -1),
             mask=lanes < num_blocks)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups the slots (token * k + j) of ids: [T, k] by expert, each expert's run padded to a multiple of
    block_m. Returns (sorted_slots [B * block_m] int32, padding = T * k; block_experts [B] int32, an expert
    id, or -1 for blocks past the end), B = ceil(T * k / block_m) + min(E, T * k): the most blocks any
    routing needs (each expert that got a token adds at most one partly filled block). Slots of one expert
    come in no set order. Two kernels (count, place): a chain of torch ops (count, cumsum, sort, scatter,
    searchsorted) took ~55 us a layer at decode, more than the experts' GEMMs."""
    num_slots = ids.numel()
    num_blocks = triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)
    flat = ids.reshape(-1)  # [S] int64 (topk's), read as int32 by the kernels
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    rank = torch.empty(num_slots, dtype=torch.int32, device=ids.device)
    sorted_slots = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    e_p2 = triton.next_power_of_2(num_experts)
    # [CHUNK, E_P2] tiles in the placing kernel: keep them near 8K elements per program.
    chunk = max(16, min(8192 // e_p2, 256))
    _count_kernel[(triton.cdiv(num_slots, 256),)](flat, counts, rank, num_slots, CHUNK=256)
    _place_kernel[(triton.cdiv(num_blocks * block_m, chunk),)](
        flat, counts, rank, sorted_slots, block_experts, num_slots, num_experts, num_blocks,
        BLOCK_M=block_m, E_P2=e_p2, CHUNK=chunk, num_warps=4)
    return sorted_slots, block_experts


@triton.jit
def _silu(g):
    # As torch's CUDA silu: x / (1 + expf(-x)) in float32 with an IEEE division.
    return tl.math.div_rn(g, 1.0 + _exp(-g))


@triton.jit
def _gate_up_epilogue(acc_gate, acc_up, b_expert, cols, col_ok, inter, limit, alpha, dtype: tl.constexpr,
                      HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr):
    """[BM, BN] float32 gate and up sums -> h [BM, BN] in `dtype`: rounded where the reference rounds, the
    biases added (b_expert: the expert's [2I] row, gate then up), then SwiGLU or GPT-OSS's clamped SwiGLU.
    Shared by the float and the MXFP4 experts' gate/up kernels."""
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    if HAS_BIAS:
        gate = (gate + tl.load(b_expert + cols, mask=col_ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        b_up = tl.load(b_expert + inter + cols, mask=col_ok, other=0.0).to(tl.float32)
        up = (up + b_up).to(dtype).to(tl.float32)
    if CLAMPED:  # GPT-OSS: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = ((up + 1.0) * tl.math.div_rn(gate, 1.0 + _exp(-alpha * gate))).to(dtype)
    else:
        h = (_silu(gate).to(dtype).to(tl.float32) * up).to(dtype)
    return h


@triton.jit
def _down_epilogue(acc, routing_ptr, slots, valid, b_expert, cols, col_ok, dtype: tl.constexpr,
                   HAS_BIAS: tl.constexpr):
    """[BM, BN] float32 down sums -> y [BM, BN] in `dtype`: rounded, the bias added (b_expert: the expert's [H]
    row), times each slot's routing weight. Shared by the float and the MXFP4 experts' down kernels."""
    weight = tl.load(routing_ptr + slots, mask=valid, other=0.0).to(tl.float32)  # [BM]
    out = acc.to(dtype).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_expert + cols, mask=col_ok, other=0.0).to(tl.float32)
        out = (out + bias[None, :]).to(dtype).to(tl.float32)
    return (out * weight[:, None]).to(dtype)


# Token counts change every step: specializing on them would only add recompiles.
@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_slots_ptr, block_experts_ptr, b_ptr,
    num_slots, top_k, hidden, inter,
    stride_x, stride_we, stride_wn, stride_h, stride_be, limit, alpha,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,
):
    # x: [T, H]; w: [E, 2I, H] (gate rows, then up rows); h: [S, I]
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
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    gate_ptrs = w_expert + cols[None, :].to(tl.int64) * stride_wn  # [1, BN]
    up_ptrs = gate_ptrs + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(gate_ptrs + ks[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        w_up = tl.load(up_ptrs + ks[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        acc_gate = tl.dot(a, w_gate, acc_gate)
        acc_up = tl.dot(a, w_up, acc_up)
    h = _gate_up_epilogue(acc_gate, acc_up, b_ptr + expert.to(tl.int64) * stride_be, cols, col_ok, inter, limit,
                          alpha, dtype, HAS_BIAS, CLAMPED)  # b: [E, 2I]
    tl.store(h_ptr + slots[:, None].to(tl.int64) * stride_h + cols[None, :], h,
             mask=valid[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def _down_kernel(
    h_ptr, w_ptr, y_ptr, routing_ptr, sorted_slots_ptr, block_experts_ptr, b_ptr,
    num_slots, hidden, inter,
    stride_h, stride_we, stride_wn, stride_y, stride_be,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    # h: [S, I]; w: [E, H, I]; y: [S, H]; routing: [S] weights in x's dtype
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
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_ptr + slots64[:, None] * stride_h + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        w = tl.load(w_ptrs + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]
        acc = tl.dot(a, w, acc)
    y = _down_epilogue(acc, routing_ptr, slots, valid, b_ptr + expert.to(tl.int64) * stride_be, cols, col_ok, dtype,
                       HAS_BIAS)  # b: [E, H]
    tl.store(y_ptr + slots64[:, None] * stride_y + cols[None, :], y, mask=valid[:, None] & col_ok[None, :])


def _launch_config(num_slots: int, num_experts: int) -> dict[str, int]:
    """Block sizes by how many slots an expert gets on average: decode batches give most experts a token or
    two (small BLOCK_M, so padding costs little; the step is bound by reading the experts' weights), prefill
    gives them full blocks."""
    if num_slots <= 16 * num_experts:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


@dataclass(frozen=True)
class ExpertPlan:
    """How a step's token slots go through the grouped kernels: routing weights [T, k] (x's dtype), the slots
    sorted by expert in blocks of BLOCK_M ([num_blocks * BLOCK_M], num_slots marking padding) with each block's
    expert ([num_blocks], -1: unused), the block sizes and launch settings."""

    weights: torch.Tensor
    sorted_slots: torch.Tensor
    block_experts: torch.Tensor
    block_m: int
    block_n: int
    block_k: int
    launch: dict


def plan_experts(x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 num_experts: int) -> ExpertPlan:
    """Routes x's [T, H] tokens and sorts their T * k slots by expert (float and MXFP4 experts alike)."""
    weights, ids = route(router_logits, top_k, renormalize, x.dtype)  # [T, k], [T, k]
    cfg = _launch_config(x.shape[0] * top_k, num_experts)
    sorted_slots, block_experts = align_by_expert(ids, num_experts, cfg["BLOCK_M"])
    return ExpertPlan(weights, sorted_slots, block_experts, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"],
                      dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))


def fused_moe_triton(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                     w_down: torch.Tensor, top_k: int, renormalize: bool, b_gate_up: torch.Tensor | None = None,
                     b_down: torch.Tensor | None = None, swiglu_limit: float = 0.0,
                     swiglu_alpha: float = 0.0) -> torch.Tensor:
    """kiln::fused_moe on CUDA. x: [T, H]; router_logits: [T, E]; w_gate_up: [E, 2I, H]; w_down: [E, H, I]
    (both with a contiguous last dim); GPT-OSS's b_gate_up [E, 2I], b_down [E, H] and clamped SwiGLU
    (swiglu_limit > 0) -> [T, H] in x's dtype."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    plan = plan_experts(x, router_logits, top_k, renormalize, num_experts)
    weights, sorted_slots, block_experts, launch = plan.weights, plan.sorted_slots, plan.block_experts, plan.launch
    block_m, block_n, block_k = plan.block_m, plan.block_n, plan.block_k
    num_blocks = block_experts.numel()
    w_gate_up = w_gate_up if w_gate_up.stride(-1) == 1 else w_gate_up.contiguous()
    w_down = w_down if w_down.stride(-1) == 1 else w_down.contiguous()
    h = x.new_empty((num_slots, inter))  # [S, I]: every slot's row is written once
    # Without biases the kernels never read their pointer (HAS_BIAS is compile-time): x stands in.
    b_gate_up_arg, b_down_arg = (x if b is None else b for b in (b_gate_up, b_down))
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w_gate_up, h, sorted_slots, block_experts, b_gate_up_arg,
        num_slots, top_k, hidden, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0), b_gate_up_arg.stride(0),
        float(swiglu_limit), float(swiglu_alpha),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=b_gate_up is not None,
        CLAMPED=swiglu_limit > 0, **launch)
    y = x.new_empty((num_slots, hidden))  # [S, H]
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, w_down, y, weights.reshape(-1), sorted_slots, block_experts, b_down_arg,
        num_slots, hidden, inter,
        h.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0), b_down_arg.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=b_down is not None, **launch)
    return y.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
