"""Triton kernels behind `kiln::scaled_linear` on CUDA (semantics: plugins/quant_linear.py).

Two launches:
1. `quantize_activations_triton`: one program per (token, group of input columns) smooths x by
   pre_quant_scale in float32, takes the group's scale (static: input_scale; dynamic: amax / qmax by IEEE
   division, floored at MIN_DYNAMIC_SCALE) and stores x / scale saturated and rounded half to even as FP8
   e4m3 or INT8, with the rounding code the quantized KV cache uses. The quantized activations and their
   scales are the reference's bit for bit. scaled_linear uses one group per token (per-token scales);
   fp8_block_linear (triton_fp8_block_linear.py) uses groups of b1 columns.
2. `_scaled_mm_kernel`: a tiled GEMM on the quantized values. INT8 accumulates exactly in int32; FP8 in
   float32, promoted out of the tensor cores' accumulator every BLOCK_K columns (Hopper's FP8 MMA keeps
   fewer accumulator bits than float32, which over a long K costs real accuracy: DeepSeek-V3 §3.3.2). The
   epilogue is the reference's: acc * s_x[t] * weight_scale[n] (+ bias) in float32, one rounding to x's
   dtype, with FMA contraction off so each float32 op rounds as torch's do. INT8 outputs therefore equal the
   reference's bit for bit; FP8 ones differ by the float32 summation order (and, in Hopper's wgmma tiles,
   the short accumulator within one K step; 16-token tiles run mma.sync on the values widened to float16,
   exact, with float32 sums).

From 17 tokens on, an FP8 GEMM in bfloat16 without bias goes to cuBLASLt instead (torch._scaled_mm with
row-wise scales: the same float32 epilogue, s_x[t] * weight_scale[n], with its own summation order, in the
tensor cores' fast accumulation: FP8_FAST_ACCUM).

Every launch setting comes from shapes, never from tensor values, and the scales stay on the device: no
host sync, so CUDA graphs capture the op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import tuning
from ._triton import sm_count as _sm_count
from .quant_limits import FP8_MAX, INT8_MAX, MIN_DYNAMIC_SCALE
from .triton_rotary_kv import _to_cache

_MIN_SCALE = tl.constexpr(MIN_DYNAMIC_SCALE)
_MAX_QUANT_BLOCK = 4096  # columns a quantization program holds at once; longer groups loop
_BLOCK_K = 128  # GEMM K step: also FP8's promotion interval, as DeepSeek-V3's and vLLM's kernels use


# --- activation quantization ---


# Token counts change every step: specializing on them would only add recompiles.
@triton.jit(do_not_specialize=["T"])
def _quantize_kernel(x_ptr, pqs_ptr, scale_ptr, xq_ptr, sx_ptr, T, K, group_size,
                     stride_xt, stride_qt, stride_st,
                     QMAX: tl.constexpr, DYNAMIC: tl.constexpr, HAS_PQS: tl.constexpr, BLOCK: tl.constexpr):
    """Token t = program 0, group g = program 1: columns [g * group_size, +group_size) of x_q, those at or
    past K (a last group's padding) stored as zeros; s_x[t, g] the group's scale."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    start = g * group_size
    if DYNAMIC:
        amax = 0.0
        for c0 in range(0, group_size, BLOCK):
            cols = start + c0 + offs
            xs = _load_smoothed(x_ptr + t * stride_xt, pqs_ptr, cols, (c0 + offs < group_size) & (cols < K),
                                HAS_PQS)
            amax = tl.maximum(amax, tl.max(tl.abs(xs), axis=0))
        # IEEE division, as the reference divides by a tensor; Triton's `/` on float32 is approximate.
        scale = tl.maximum(tl.math.div_rn(amax, QMAX), _MIN_SCALE)
    else:
        scale = tl.load(scale_ptr)  # [1] float32 on the device: no host sync
    for c0 in range(0, group_size, BLOCK):
        cols = start + c0 + offs
        in_group = c0 + offs < group_size
        xs = _load_smoothed(x_ptr + t * stride_xt, pqs_ptr, cols, in_group & (cols < K), HAS_PQS)
        # x / scale (div_rn), saturated to the format's range, rounded half to even: the KV cache's rounding.
        tl.store(xq_ptr + t * stride_qt + cols, _to_cache(xs, scale, xq_ptr, True), mask=in_group)
    tl.store(sx_ptr + t * stride_st + g, scale)


@triton.jit
def _load_smoothed(row_ptr, pqs_ptr, cols, mask, HAS_PQS: tl.constexpr):
    # -> [BLOCK] float32: x.float() * pre_quant_scale, rounded once as the reference's; 0 where masked.
    xs = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_PQS:
        xs = xs * tl.load(pqs_ptr + cols, mask=mask, other=0.0)
    return xs


def quantize_activations_triton(
    x: torch.Tensor, qdtype: torch.dtype, group_size: int, input_scale: torch.Tensor | None = None,
    pre_quant_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] float (last dim contiguous) -> (x_q [T, G * group_size] qdtype, s_x [T, G] float32),
    G = ceil(K / group_size); columns past K are zeros.

    qdtype: torch.float8_e4m3fn (qmax 448) or torch.int8 (qmax 127). input_scale: [1] float32, one static
    scale (then group_size must be K), or None: each group's amax / qmax, floored at MIN_DYNAMIC_SCALE.
    pre_quant_scale: [K] float32 multiplies x first. Bit-equal to scaled_linear_reference's x_q
    (group_size = K) and to fp8_block_linear's quantize_activation_groups (group_size = b1).
    """
    t, k = x.shape
    groups = triton.cdiv(k, group_size)
    x_q = torch.empty((t, groups * group_size), dtype=qdtype, device=x.device)
    s_x = torch.empty((t, groups), dtype=torch.float32, device=x.device)
    if t == 0:
        return x_q, s_x
    block = min(triton.next_power_of_2(group_size), _MAX_QUANT_BLOCK)
    # Unused pointers get any tensor: their loads are compiled out by the constexpr flags.
    pqs = x if pre_quant_scale is None else pre_quant_scale.contiguous()
    _quantize_kernel[(t, groups)](
        x, pqs, s_x if input_scale is None else input_scale, x_q, s_x, t, k, group_size,
        x.stride(0), x_q.stride(0), s_x.stride(0),
        QMAX=FP8_MAX if qdtype == torch.float8_e4m3fn else INT8_MAX, DYNAMIC=input_scale is None,
        HAS_PQS=pre_quant_scale is not None, BLOCK=block,
        num_warps=max(1, min(8, block // 256)), enable_fp_fusion=False)
    return x_q, s_x


# --- GEMM tiles, shared with triton_fp8_block_linear.py ---


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # tokens per tile: a power of two >= 16 (tl.dot's minimum)
    block_n: int  # output features per tile
    num_warps: int
    num_stages: int
    split_k: int = 1  # K ranges summed by a second kernel (scaled_linear's decode; fp8_block_linear uses 1)


_MIN_STEPS_PER_SPLIT = 4  # K steps of _BLOCK_K a split streams at least: shorter ones cost more than they bring


def gemm_config(t: int, n: int, num_sms: int, k: int | None = None) -> GemmConfig:
    """Tiles for a 1-byte-operand GEMM with K steps of 128, from shapes only (CUDA graphs replay them).

    Decode (T <= 16) is memory-bound: 16-token tiles, and 32-column ones when 64 would leave SMs idle
    (N = 6144 gives 96 tiles of 64 for 132 SMs), with deep pipelines to keep weight loads in flight; given K,
    K is also split (scaled_linear) until every SM streams several tiles. Prefill grows the tile toward
    128 x 128, where the 8-bit tensor cores stay busy; 3 stages of its 32 KiB of operands also fit the 100 KiB
    of shared memory of sm_89 GPUs (L4, L40S).
    """
    block_m = 16 if t <= 16 else min(triton.next_power_of_2(t), 128)
    if block_m <= 32:
        block_n = 64 if triton.cdiv(t, block_m) * triton.cdiv(n, 64) >= num_sms else 32
        split_k = 1
        if k is not None and block_m == 16:
            tiles = triton.cdiv(n, block_n)
            split_k = max(1, min(triton.cdiv(4 * num_sms, tiles), triton.cdiv(k, _BLOCK_K) // _MIN_STEPS_PER_SPLIT,
                                 8))
        return GemmConfig(block_m, block_n, num_warps=4, num_stages=5, split_k=split_k)
    if block_m == 64:
        return GemmConfig(64, 128, num_warps=4, num_stages=4)
    return GemmConfig(128, 128, num_warps=8, num_stages=3)


TUNED_KERNEL = "scaled_linear"  # its name in target.kernel_settings


def tuning_key(t: int, n: int, k: int, int8: bool) -> str:
    """The shape key of a scaled_linear launch in the tuning table (tokens by tile height)."""
    block_m = 16 if t <= 16 else min(triton.next_power_of_2(t), 128)
    return f"m{block_m}_n{n}_k{k}_{'int8' if int8 else 'fp8'}"


def tuning_candidates() -> tuple[list[dict], Callable[[dict], list[dict]]]:
    """What build-time tuning (builder/tune.py) times for decode, in two rounds: tile widths and K splits,
    then warps and pipeline depths around the best of those; settings as GemmConfig takes them (but block_m)."""
    first = [{"block_n": bn, "split_k": split, "num_warps": 4, "num_stages": 5}
             for bn in (32, 64, 128) for split in (1, 2, 4, 8)]

    def second(best: dict) -> list[dict]:
        return [{**best, "num_warps": w, "num_stages": st} for w in (2, 4, 8) for st in (3, 4, 5, 6)]
    return first, second


# --- scaled_linear ---


@triton.jit
def _epilogue(acc, sx_ptr, ws_ptr, bias_ptr, out_ptr, rows, cols, a_rows, w_rows, T, N, stride_ot,
              HAS_BIAS: tl.constexpr):
    """y = acc * s_x[rows] * weight_scale[cols] (+ bias) in float32, the reference's order, rounded once."""
    s_x = tl.load(sx_ptr + a_rows)  # [BLOCK_M] float32
    w_scale = tl.load(ws_ptr + w_rows)  # [BLOCK_N] float32
    y = acc.to(tl.float32) * s_x[:, None] * w_scale[None, :]  # the reference's order: (acc * s_x) * w_scale
    if HAS_BIAS:
        y += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
    out_mask = (rows < T)[:, None] & (cols < N)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["T"])
def _scaled_mm_kernel(a_ptr, w_ptr, sx_ptr, ws_ptr, bias_ptr, out_ptr, T, N, K, k_per_split,
                      stride_at, stride_wn, stride_ot, stride_split,
                      INT8: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of y = (x_q @ W^T) * s_x[rows] * weight_scale[cols] (+ bias) over the K range
    [split * k_per_split, +k_per_split) ∩ [0, K). SPLIT_K == 1 writes y; SPLIT_K > 1 writes the raw sums
    (int32 for INT8: still exact; float32 for FP8) to out_ptr[split] for _sum_splits_kernel."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] tokens
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    split = tl.program_id(2)
    # Rows and columns past the edge read a valid one (modulo) instead of masking: loads stay unmasked along
    # M and N, and the store drops them.
    a_rows = (rows % T).to(tl.int64)
    w_rows = (cols % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    if INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + offs_k  # [BLOCK_K] input features
        a_offs = a_rows[:, None] * stride_at + ks[None, :]  # [BLOCK_M, BLOCK_K]
        w_offs = w_rows[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]: W's rows are K-major
        if EVEN_K:
            a = tl.load(a_ptr + a_offs)
            w = tl.load(w_ptr + w_offs)
        else:  # zeros past K add nothing
            a = tl.load(a_ptr + a_offs, mask=(ks < K)[None, :], other=0.0)
            w = tl.load(w_ptr + w_offs, mask=(ks < K)[None, :], other=0.0)
        if INT8:
            acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)  # exact integer sums
        else:
            # Products of e4m3 values are exact; the sums move to the float32 accumulator every BLOCK_K.
            acc = tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=BLOCK_K)
    if SPLIT_K == 1:
        _epilogue(acc, sx_ptr, ws_ptr, bias_ptr, out_ptr, rows, cols, a_rows, w_rows, T, N, stride_ot, HAS_BIAS)
    else:
        part = out_ptr + split * stride_split + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(part, acc, mask=(rows < T)[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["T"])
def _sum_splits_kernel(part_ptr, sx_ptr, ws_ptr, bias_ptr, out_ptr, T, N, stride_split, stride_ot,
                       SPLIT_K: tl.constexpr, INT8: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Adds a row's split sums in split order (int32: exact; float32: a fixed order, deterministic) and
    applies _scaled_mm_kernel's epilogue."""
    row = tl.program_id(0)
    rows = row + tl.arange(0, 1)  # [1]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    w_rows = (cols % N).to(tl.int64)
    offs = rows.to(tl.int64)[:, None] * N + w_rows[None, :]  # [1, BLOCK_N]
    if INT8:
        acc = tl.zeros((1, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + split * stride_split + offs)
    _epilogue(acc, sx_ptr, ws_ptr, bias_ptr, out_ptr, rows, cols, rows.to(tl.int64), w_rows, T, N, stride_ot,
              HAS_BIAS)


# Tokens from which the FP8 GEMM goes to cuBLASLt: below, the Triton kernel's 16-row tiles read the weight
# at least as fast (decode is bound by the weight's bytes); above, cuBLASLt's wgmma kernels win prefill and
# large batches.
CUBLASLT_MIN_TOKENS = 17
# cuBLASLt's FP8 GEMMs accumulate in the tensor cores' own accumulator, never promoted to float32 (what
# TensorRT-LLM's and vLLM's FP8 GEMMs do on Hopper). H200, Llama-8B shapes (scripts/bench_fp8_gemm.py): 5-12%
# faster at M = 1,024-8,192, the largest error 5e-3 to 1.2e-2 of the output's largest magnitude against
# 2.3e-3 to 3.1e-3 (K = 4,096 / 14,336); a 128 / 128 x 3000 FP8 run 24,225-24,663 -> 25,634-26,274 output
# tok/s (scripts/profile_throughput.py, same machine, against --fp8-exact-accum). False: float32 promotion.
FP8_FAST_ACCUM = True


def _takes_cublaslt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype | None = None) -> bool:
    """Whether FP8 x_q @ weight^T runs as torch._scaled_mm (cuBLASLt, row-wise scales): FP8 weights on a GPU
    with FP8 tensor cores (compute capability 8.9+), bfloat16 out (what row-wise scaling supports), no bias
    (the bias would round in another place than the reference's), dims multiples of 16 (cuBLASLt's rule).
    x: [T, K], the activations or their quantized values; out_dtype: the output's, x's dtype if None."""
    t, k = x.shape
    n = weight.shape[0]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    return (weight.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16 and bias is None
            and t >= CUBLASLT_MIN_TOKENS and k % 16 == 0 and n % 16 == 0 and _has_fp8_tensor_cores(x.device))


@functools.cache
def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor | None, bias: torch.Tensor | None,
                         pre_quant_scale: torch.Tensor | None) -> torch.Tensor:
    """kiln::scaled_linear on CUDA. x: [T, K] float; weight: [N, K] float8_e4m3fn / int8, contiguous;
    weight_scale: [N] float32; input_scale: [1] float32 or None (dynamic per token); bias: [N] x.dtype;
    pre_quant_scale: [K] float32 -> [T, N] x.dtype. Arguments as checked by quant_linear.scaled_linear."""
    t, k = x.shape
    if t == 0 or weight.shape[0] == 0:
        return x.new_empty((t, weight.shape[0]))
    x_q, s_x = quantize_activations_triton(x, weight.dtype, k, input_scale, pre_quant_scale)  # [T, K], [T, 1]
    return _quantized_gemm(x_q, s_x, weight, weight_scale, bias, x.dtype)


def scaled_linear_quantized_triton(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                                   weight_scale: torch.Tensor, bias: torch.Tensor | None,
                                   out_dtype: torch.dtype) -> torch.Tensor:
    """kiln::scaled_linear_quantized on CUDA: scaled_linear_triton's GEMM on activations quantized by their
    producer. x_q: [T, K] float8_e4m3fn; x_scale: [T, 1] float32 (or [1]: one scale, copied out to the rows
    the kernels and cuBLASLt's row-wise scaling read); weight: [N, K] float8_e4m3fn, contiguous; weight_scale:
    [N] float32; bias: [N] out_dtype -> [T, N] out_dtype. Arguments as checked by quant_linear."""
    t = x_q.shape[0]
    if x_scale.dim() == 1 or x_scale.stride(0) != 1:
        x_scale = x_scale.expand(t, 1).contiguous()
    return _quantized_gemm(x_q, x_scale, weight, weight_scale, bias, out_dtype)


def _quantized_gemm(x_q: torch.Tensor, s_x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """y = (x_q @ weight^T) * s_x * weight_scale (+ bias) -> [T, N] out_dtype: cuBLASLt where it takes the
    shape, else _scaled_mm_kernel with tuned or heuristic tiles. x_q: [T, K]; s_x: [T, 1] float32, contiguous."""
    t, k = x_q.shape
    n = weight.shape[0]
    out = torch.empty((t, n), dtype=out_dtype, device=x_q.device)
    if out.numel() == 0:
        return out
    if _takes_cublaslt(x_q, weight, bias, out_dtype):
        # weight.t(): [K, N] column-major, the layout cuBLASLt's FP8 GEMM wants for its second operand.
        return torch._scaled_mm(x_q, weight.t(), scale_a=s_x, scale_b=weight_scale.view(1, n),
                                out_dtype=out_dtype, use_fast_accum=FP8_FAST_ACCUM)
    int8 = weight.dtype == torch.int8
    tuned = tuning.lookup(TUNED_KERNEL, tuning_key(t, n, k, int8)) if t <= 16 else None
    cfg = GemmConfig(16, **tuned) if tuned else gemm_config(t, n, _sm_count(x_q.device), k)
    # `out` stands in for a missing bias: the dtype a bias has, so the kernels compile as they always have.
    return _launch(out, x_q, s_x, weight, weight_scale, bias, out, cfg)


def _launch(x, x_q, s_x, weight, weight_scale, bias, out, cfg: GemmConfig) -> torch.Tensor:
    """_scaled_mm_kernel (and with split_k > 1 _sum_splits_kernel) into `out`: [T, N]. x: a tensor of the
    output's dtype on the device (the activations, or `out`), standing in for a missing bias."""
    t, k = x_q.shape
    n = weight.shape[0]
    int8 = weight.dtype == torch.int8
    # K ranges of whole steps, none empty.
    steps = triton.cdiv(k, _BLOCK_K)
    per_split = triton.cdiv(steps, max(1, min(cfg.split_k, steps)))
    split_k = triton.cdiv(steps, per_split)
    part = out if split_k == 1 else torch.empty((split_k, t, n), dtype=torch.int32 if int8 else torch.float32,
                                                device=x.device)
    # The [N] vectors are read as contiguous (a no-op for the contiguous ones the layers hold).
    w_scale = weight_scale.contiguous()
    bias_arg = x if bias is None else bias.contiguous()
    grid = (triton.cdiv(t, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
    _scaled_mm_kernel[grid](
        x_q, weight, s_x, w_scale, bias_arg, part, t, n, k, per_split * _BLOCK_K,
        x_q.stride(0), weight.stride(0), out.stride(0), part.stride(0) if split_k > 1 else 0,
        INT8=int8, HAS_BIAS=bias is not None, EVEN_K=k % _BLOCK_K == 0, SPLIT_K=split_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=_BLOCK_K,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        # A fused multiply-add would skip a rounding of the reference's epilogue.
        enable_fp_fusion=False)
    if split_k > 1:
        block_n = 256
        _sum_splits_kernel[(t, triton.cdiv(n, block_n))](
            part, s_x, w_scale, bias_arg, out, t, n, part.stride(0), out.stride(0),
            SPLIT_K=split_k, INT8=int8, HAS_BIAS=bias is not None, BLOCK_N=block_n, num_warps=4,
            enable_fp_fusion=False)
    return out
