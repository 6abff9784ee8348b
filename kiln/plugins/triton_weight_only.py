"""Triton kernel behind `kiln::weight_only_linear` on CUDA (semantics: plugins/quant_linear.py).

A tiled GEMM: a program owns a BLOCK_M x BLOCK_N tile of y = x @ W^T and walks K in BLOCK_K steps. Each
step loads the quantized weight tile as stored (INT4: two columns a byte, so BLOCK_K // 2 bytes a row;
INT8: one), dequantizes it in registers exactly as the reference does (q = u - zero point in float32, times
the group's float32 scale, one rounding to x's dtype) and feeds tl.dot with float32 accumulation. x is
smoothed by pre_quant_scale in float32 and rounded to its dtype first, as the reference does (smooth_triton,
one pass before the GEMM); the bias is
added in float32 and the output rounded once. The dequantized weights and smoothed activations are thus the
reference's bit for bit; only the float32 summation order differs.

INT4 steps inside one group (the common AWQ/GPTQ g128 decode) skip the dequantization (_int4_group_step): the
nibbles enter the dot as exact 16-bit floats made by a bitcast, and the zero point and scale are applied to
the group's partial sums. Per weight element that is a few integer operations instead of three conversions
and two float operations, which left the decode GEMV bound by instructions (28% of the H100's bandwidth).
The weight is then not rounded to x's dtype element by element as the reference rounds it: the result
differs from the reference by about one rounding of x's dtype (relative 2**-9 in bfloat16) per product,
averaged over K, far inside the tests' tolerance.

Scales: when a BLOCK_K step lies inside one group (group_size a multiple of BLOCK_K, no g_idx) each row reads
one scale (and zero point) a step; otherwise (act-order g_idx, small or odd groups) every column gathers its
own, which costs more loads but is correct for any group_size dividing K.

Split-K: when the output has fewer tiles than the GPU has SMs (decode, small N), K is cut into SPLIT_K
contiguous ranges whose float32 partial sums go to a workspace that a second kernel adds in a fixed order
(deterministic, unlike atomics), then adds the bias and rounds. Every launch setting comes from shapes only,
never from tensor values, so CUDA graphs capture and replay it: the tiles, splits, tuning keys and candidates
are triton_weight_only_config.py's (imported here too, as the tunable kernel's TUNED_KERNEL, tuning_key and
tuning_candidates).

From DEQUANT_MIN_TOKENS tokens (prefill, large batches) the weight is instead dequantized whole by
triton_dequantize.py and multiplied by cuBLAS (F.linear).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import tuning
from ._triton import sm_count as _sm_count
from .triton_dequantize import dequantize_weight_triton
from .triton_smooth import smooth_triton
from .triton_weight_only_config import (
    DEQUANT_MIN_TOKENS,
    TUNED_KERNEL,
    _int4_fast,
    _launch_config,
    _LaunchConfig,
    config_with,
    tuning_candidates,  # noqa: F401  (the tunable kernel's interface: builder/tune.py imports it from here)
    tuning_key,
)


@triton.jit
def _dequantized_step(acc, x_ptr, qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, x_rows, w_rows, k0, K,
                      group_size, stride_xm, stride_qn, stride_sn, stride_sg, stride_zn, stride_zg, stride_gk,
                      BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                      GROUP_ALIGNED: tl.constexpr, EVEN_K: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + x[:, k0:k0+BLOCK_K] @ W^T for any format: the weight tile dequantized as the reference does."""
    dtype = x_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    ks = k0 + offs_k  # [BLOCK_K] input features
    k_ok = ks < K
    x_offs = x_rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    if EVEN_K:
        xt = tl.load(x_ptr + x_offs)
    else:
        xt = tl.load(x_ptr + x_offs, mask=k_ok[None, :], other=0.0)

    if BITS == 4:
        # Byte j of a row holds column 2j (low nibble) and 2j + 1 (high): joining (low, high) on a new last
        # axis and flattening it puts them back in column order.
        bytes_k = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BLOCK_K // 2]
        q_offs = w_rows[:, None] * stride_qn + bytes_k[None, :]  # [BLOCK_N, BLOCK_K // 2]
        if EVEN_K:
            packed = tl.load(qw_ptr + q_offs)
        else:
            packed = tl.load(qw_ptr + q_offs, mask=(bytes_k < K // 2)[None, :], other=0)
        u = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32)
    else:
        q_offs = w_rows[:, None] * stride_qn + ks[None, :]  # [BLOCK_N, BLOCK_K]
        if EVEN_K:
            u = tl.load(qw_ptr + q_offs).to(tl.float32)
        else:
            u = tl.load(qw_ptr + q_offs, mask=k_ok[None, :], other=0).to(tl.float32)

    if GROUP_ALIGNED:  # the whole step is one group: one scale (and zero point) per row
        g = k0 // group_size
        s = tl.load(scales_ptr + w_rows * stride_sn + g * stride_sg)[:, None]  # [BLOCK_N, 1]
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + w_rows * stride_zn + g * stride_zg)[:, None]
    else:  # a group per column: gathered (columns past K read group 0 / the last group, any valid one)
        if HAS_G_IDX:
            g = tl.load(g_idx_ptr + ks * stride_gk, mask=k_ok, other=0)  # [BLOCK_K] int32
        else:
            g = tl.minimum(ks, K - 1) // group_size
        s = tl.load(scales_ptr + w_rows[:, None] * stride_sn + g[None, :] * stride_sg)  # [BLOCK_N, BLOCK_K]
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + w_rows[:, None] * stride_zn + g[None, :] * stride_zg)
    if HAS_ZEROS:
        q = u - z.to(tl.float32)
    elif BITS == 4:
        q = u - 8.0  # symmetric INT4 stores q + 8
    else:
        q = u  # symmetric INT8 is stored signed
    w = (q * s).to(dtype)  # [BLOCK_N, BLOCK_K]: the reference's dequantized weight, bit for bit
    acc = tl.dot(xt, tl.trans(w), acc, input_precision=DOT_PRECISION)

    return acc


@triton.jit
def _packed_tile(q_rows, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The INT4 bytes of input features [k0, k0 + BLOCK_K): [BLOCK_N, BLOCK_K // 2] uint8 (q_rows: [BLOCK_N, 1]
    row pointers)."""
    bytes_k = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    if EVEN_K:
        return tl.load(q_rows + bytes_k[None, :])
    return tl.load(q_rows + bytes_k[None, :], mask=(bytes_k < K // 2)[None, :], other=0)


@triton.jit
def _int4_group_step(acc, packed, x_ptr, scales_ptr, zeros_ptr, x_rows, w_rows, k0, K, group_size,
                     stride_xm, stride_sn, stride_sg, stride_zn, stride_zg, HAS_ZEROS: tl.constexpr, EVEN_K: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + x[:, k0:k0+BLOCK_K] @ W^T for INT4 with the step inside one group, without dequantizing.

    The nibbles u go to the tensor cores as they are: OR-ing a 16-bit float's exponent over them makes the
    exact value off + u (1024 + u in float16, 128 + u in bfloat16: integers that format holds exactly), a
    bitcast, no conversion instruction. The group's zero point and scale come after the dot, once per output:
    sum_k (u - z) s x = s (sum_k (off + u) x - (off + z) sum_k x). Byte j holds columns 2j (low nibble) and
    2j + 1 (high), so x is read as its even and odd columns, one dot each: no interleaving of the tile.
    """
    dtype = x_ptr.dtype.element_ty
    half = tl.arange(0, BLOCK_K // 2)
    ke = k0 + 2 * half  # [BLOCK_K // 2] even input features
    x_offs = x_rows[:, None] * stride_xm + ke[None, :]  # [BLOCK_M, BLOCK_K // 2]
    if EVEN_K:
        xe = tl.load(x_ptr + x_offs)
        xo = tl.load(x_ptr + x_offs + 1)
    else:
        xe = tl.load(x_ptr + x_offs, mask=(ke < K)[None, :], other=0.0)
        xo = tl.load(x_ptr + x_offs + 1, mask=(ke + 1 < K)[None, :], other=0.0)
    lo, hi = packed & 0xF, packed >> 4  # packed: [BLOCK_N, BLOCK_K // 2] uint8, this step's bytes
    if dtype == tl.float16:
        off = 1024.0
        wl = (lo.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        wh = (hi.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    elif dtype == tl.bfloat16:
        off = 128.0
        wl = (lo.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
        wh = (hi.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
    else:  # float32 activations: the nibbles converted (exact), no offset
        off = 0.0
        wl = lo.to(tl.float32)
        wh = hi.to(tl.float32)
    part = tl.dot(xe, tl.trans(wl), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] float32
    part = tl.dot(xo, tl.trans(wh), part, input_precision=DOT_PRECISION)
    x_sum = tl.sum(xe.to(tl.float32), axis=1) + tl.sum(xo.to(tl.float32), axis=1)  # [BLOCK_M]
    g = k0 // group_size
    s = tl.load(scales_ptr + w_rows * stride_sn + g * stride_sg)  # [BLOCK_N] float32
    if HAS_ZEROS:
        z = tl.load(zeros_ptr + w_rows * stride_zn + g * stride_zg).to(tl.float32)
    else:
        z = tl.full(s.shape, 8.0, tl.float32)  # symmetric INT4 stores q + 8
    return acc + (part - x_sum[:, None] * (z + off)[None, :]) * s[None, :]


@triton.jit
def _weight_only_kernel(x_ptr, qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, bias_ptr, out_ptr,
                        T, N, K, group_size, k_per_split, stride_xm, stride_xp, part_b1, part_b2, stride_qn,
                        stride_sn, stride_sg,
                        stride_zn, stride_zg, stride_gk, stride_b, stride_om, stride_split,
                        BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                        GROUP_ALIGNED: tl.constexpr, HAS_BIAS: tl.constexpr,
                        EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        INT4_FAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """One BLOCK_M x BLOCK_N output tile over K range [split * k_per_split, +k_per_split) ∩ [0, K).
    SPLIT_K == 1 writes y in x's dtype; SPLIT_K > 1 writes the float32 partial to out_ptr[split].
    A layer of parts (weight_only_linear_parts) has x as [P, T, K], one smoothed x per part: output columns
    from part_b1 (and from part_b2) read the next part's x, stride_xp further; no tile straddles a bound."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    col0 = pid_n * BLOCK_N
    x_ptr += ((col0 >= part_b1).to(tl.int64) + (col0 >= part_b2).to(tl.int64)) * stride_xp
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] tokens
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    # Rows and columns past the edge read a valid row (modulo) instead of masking: the weight loads stay
    # unmasked along N (vectorized), and the store masks them out.
    x_rows = (rows % T).to(tl.int64)
    w_rows = (cols % N).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if INT4_FAST:
        q_rows = qw_ptr + w_rows[:, None] * stride_qn  # [BLOCK_N, 1]
        for k0 in range(k_start, k_end, BLOCK_K):
            # Loading the next step's bytes ahead by hand (two tiles in flight) measured 10-30% slower on the H100.
            acc = _int4_group_step(acc, _packed_tile(q_rows, k0, K, EVEN_K, BLOCK_K), x_ptr, scales_ptr, zeros_ptr,
                                   x_rows, w_rows, k0, K, group_size, stride_xm, stride_sn, stride_sg, stride_zn,
                                   stride_zg, HAS_ZEROS, EVEN_K, DOT_PRECISION, BLOCK_K)
    else:
        for k0 in range(k_start, k_end, BLOCK_K):
            acc = _dequantized_step(acc, x_ptr, qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, x_rows, w_rows, k0, K,
                                    group_size, stride_xm, stride_qn, stride_sn, stride_sg, stride_zn, stride_zg,
                                    stride_gk, BITS, HAS_ZEROS, HAS_G_IDX, GROUP_ALIGNED, EVEN_K, DOT_PRECISION,
                                    BLOCK_N, BLOCK_K)

    out_mask = (rows < T)[:, None] & (cols < N)[None, :]
    rows = rows.to(tl.int64)  # T * N may pass 2**31 (a long prefill through the lm_head)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + w_rows * stride_b).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        part = out_ptr + split * stride_split + rows[:, None] * stride_om + cols[None, :]
        tl.store(part, acc, mask=out_mask)


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, N, stride_split, stride_pm, stride_b, stride_om,
                       SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, cols] = sum over splits, in split order, of part[split, m, cols] (+ bias), rounded once."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + split * stride_split + row * stride_pm + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols * stride_b, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _stride(vector: torch.Tensor | None) -> int:
    return 0 if vector is None else vector.stride(0)


def part_bounds(part_sizes: list[int] | tuple[int, ...]) -> list[int]:
    """The output columns where each part after the first begins."""
    return [sum(part_sizes[:i]) for i in range(1, len(part_sizes))]


def _launch(x, qweight, scales, zeros, bits, group_size, bias, pre_quant_scale, g_idx,
            cfg: _LaunchConfig, part_sizes: list[int] | tuple[int, ...] | None = None) -> torch.Tensor:
    """One GEMM (and its split-K sum). With part_sizes, pre_quant_scale is [P, K] and parts_fit holds."""
    n = qweight.shape[0]
    stride_xp, bounds = 0, [n, n]
    if pre_quant_scale is not None:
        x = smooth_triton(x, pre_quant_scale)  # [T, K], or [P, T, K] for parts
    if part_sizes is not None:
        stride_xp = x.stride(0)
        bounds = (part_bounds(part_sizes) + bounds)[:2]
        x = x[0]  # part 0's x; the kernel steps stride_xp per part
    t, k = x.shape
    out = x.new_empty((t, n))
    # Unused pointer arguments get any tensor: their loads are compiled out by the constexpr flags.
    part = out if cfg.split_k == 1 else torch.empty((cfg.split_k, t, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(t, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _weight_only_kernel[grid](
        x, qweight, scales, scales if zeros is None else zeros, x if g_idx is None else g_idx,
        x if bias is None else bias, part,
        t, n, k, group_size, cfg.k_per_split, x.stride(0), stride_xp, *bounds, qweight.stride(0), *scales.stride(),
        *(zeros.stride() if zeros is not None else (0, 0)), _stride(g_idx), _stride(bias),
        part.stride(-2), part.stride(0) if cfg.split_k > 1 else 0,
        BITS=bits, HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None, GROUP_ALIGNED=cfg.group_aligned,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        SPLIT_K=cfg.split_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        INT4_FAST=_int4_fast(cfg, bits, t), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.split_k > 1:
        block = 256
        _sum_splits_kernel[(t, triton.cdiv(n, block))](
            part, x if bias is None else bias, out, n, part.stride(0), part.stride(1), _stride(bias), out.stride(0),
            SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out


def weight_only_linear_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None,
    pre_quant_scale: torch.Tensor | None,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """kiln::weight_only_linear on CUDA; arguments as weight_only_linear_reference (checked by the wrapper).
    x: [T, K] (last dim contiguous); qweight: [N, K // 2] uint8 (4 bits) or [N, K] int8 / uint8 (8 bits);
    scales, zeros: [N, K // group_size]; bias: [N]; pre_quant_scale, g_idx: [K] -> [T, N] in x's dtype."""
    t, n = x.shape[0], qweight.shape[0]
    if t == 0 or n == 0:
        return x.new_empty((t, n))
    if t >= DEQUANT_MIN_TOKENS:
        w = dequantize_weight_triton(qweight, scales, zeros, bits, group_size, x.dtype, g_idx)  # [N, K]
        xs = x if pre_quant_scale is None else smooth_triton(x, pre_quant_scale)
        return F.linear(xs, w, bias)
    cfg = _config(x, n, bits, group_size, g_idx is not None, zeros is not None)
    return _launch(x, qweight, scales, zeros, bits, group_size, bias, pre_quant_scale, g_idx, cfg)


def _config(x: torch.Tensor, n: int, bits: int, group_size: int, has_g_idx: bool, has_zeros: bool,
            tuned_ok: Callable[[_LaunchConfig], bool] = lambda cfg: True) -> _LaunchConfig:
    """The tuned settings of this shape (when they pass tuned_ok), else the shape heuristic."""
    t, k = x.shape
    tuned = tuning.lookup(TUNED_KERNEL, tuning_key(t, n, k, bits, group_size, has_g_idx, has_zeros))
    if tuned:
        cfg = config_with(t, k, group_size, has_g_idx, **tuned)
        if tuned_ok(cfg):
            return cfg
    return _launch_config(t, n, k, bits, group_size, has_g_idx, _sm_count(x.device))
