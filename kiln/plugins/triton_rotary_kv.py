"""Triton kernel behind kiln::rotary_embedding, kiln::write_kv_cache and kiln::rotary_embedding_and_write_kv.

One kernel with two compile-time switches: ROTATE (rotate q and k) and WRITE_KV (store k and v into the
paged cache; otherwise the rotated k goes to its own output). With both on, the decode path rotates and
caches in one launch. Each program handles one token and a block of heads. Under partial rotary (cos, sin
[T, R/2] with R < D) the first R dims of each head rotate (pairs i, i + R/2) and the last REST = D - R pass
through to q's output, k's and v's cache as they are.

Rounding follows rotary.py: cos/sin are rounded to the activation dtype, each product and the sum are
rounded to the dtype, so q and k match the reference bit for bit. The cache store casts to the cache dtype;
a quantized cache (QUANTIZED: float8_e4m3fn or int8) stores x / scale rounded as kv_cache.quantize_kv does,
with the per-layer scales read from device memory (no host sync: the decode step runs in CUDA graphs), so
the cache bytes match the reference's too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Heads per program times half the head dim: enough work per program without spilling registers.
_ELEMENTS_PER_PROGRAM = 1024
_FP8_MAX = tl.constexpr(448.0)  # torch.finfo(torch.float8_e4m3fn).max
# 1.5 * 2**23: for |x| <= 2**22, x + _ROUND_INT lies in [2**23, 2**24), where float32 holds integers only, so
# the add rounds x to an integer, half to even like torch.round, and the subtraction gives it back exactly.
_ROUND_INT = tl.constexpr(12582912.0)


@triton.jit
def _to_fp8(x):
    """x: float32 within +-448 -> float8_e4m3fn, rounded half to even as torch's .to(). The GPU's conversion
    (cvt.rn.satfinite) would round so, but Triton's interpreter, which runs the CPU tests, rounds float8
    wrongly: rounding on the float8 grid in float32 first makes the conversion exact on both, so the CPU
    tests check the code the GPU runs (a few ALU ops per element, in a memory-bound kernel)."""
    # The grid's step near |x| is 2**(e - 3) for x's exponent e, and 2**-9 (subnormals) below 2**-6: adding
    # 1.5 * 2**(e + 20) rounds |x| to a multiple of the step, as _ROUND_INT does to integers.
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # biased float32 exponent
    magic = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (tl.abs(x) + magic) - magic  # >= 0
    # x's sign bit put back by bits, not by negation: the compiler may emit -r as 0 - r, which turns a tiny
    # negative value rounded to 0 into +0.0 where the reference keeps -0.0 (seen on an H100).
    signed = rounded.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)
    return signed.to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def _to_cache(x, scale, cache_ptr, QUANTIZED: tl.constexpr):
    """x in the cache's dtype: a float cache's through float32 (one rounding, as torch's .to()); QUANTIZED:
    x / scale (IEEE division, as torch's) saturated and rounded as kv_cache.quantize_kv does."""
    ty = cache_ptr.dtype.element_ty
    x = x.to(tl.float32)
    if not QUANTIZED:
        out = x.to(ty)
    else:
        x = tl.math.div_rn(x, scale)  # Triton's `/` on float32 is an approximate division
        if ty == tl.int8:
            # Clamping to the integer bounds first gives the reference's round-then-clamp.
            x = tl.minimum(tl.maximum(x, -128.0), 127.0)
            out = ((x + _ROUND_INT) - _ROUND_INT).to(tl.int8)
        else:
            out = _to_fp8(tl.minimum(tl.maximum(x, -_FP8_MAX), _FP8_MAX))
    return out


@triton.jit
def _rotate(x1, x2, cos, sin):
    # x1, x2: [BLOCK_H, BLOCK_HALF] both halves of the heads; cos, sin: [1, BLOCK_HALF] float32 holding values
    # of x's dtype. out = x * cos + rotate_half(x) * sin, rounding each op to the dtype like the reference;
    # a product of two 16-bit floats is exact in float32, so each rounds once.
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _rotary_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale_ptr, v_scale_ptr,
    num_q_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_q_out_t, stride_q_out_h, stride_k_out_t, stride_k_out_h,
    stride_cos_t, stride_cos_d, stride_sin_t, stride_sin_d,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr,
    BLOCK_H: tl.constexpr, ROTATE: tl.constexpr, WRITE_KV: tl.constexpr, QUANTIZED: tl.constexpr,
):
    # HALF: half the rotated dims (the head's half without partial rotary); REST: the dims after them (0
    # without partial rotary), copied as they are.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    lo = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF] dims of the first half; lo + HALF the second
    lo_mask = lo < HALF
    kv_heads = heads < num_kv_heads
    kv_mask = kv_heads & lo_mask
    if WRITE_KV:
        slot = tl.load(slot_ptr + token)  # int64; -1 skips the token
        # A where, not `kv_mask & (slot >= 0)`: Triton's interpreter mistypes a scalar condition broadcast by &.
        kv_mask = tl.where(slot >= 0, kv_mask, False)
        kv_heads = tl.where(slot >= 0, kv_heads, False)
        # [BLOCK_H, 1] in the contiguous caches
        cache_offsets = (slot * num_kv_heads + heads) * (2 * HALF + REST)
    k_in = k_ptr + token * stride_kt + heads * stride_kh
    k1 = tl.load(k_in + lo * stride_kd, mask=kv_mask)
    k2 = tl.load(k_in + (lo + HALF) * stride_kd, mask=kv_mask)
    if ROTATE:
        # The reference casts the float32 table to the activation dtype before rotating.
        dtype = q_ptr.dtype.element_ty
        cos = tl.load(cos_ptr + token * stride_cos_t + lo * stride_cos_d, mask=lo_mask)
        sin = tl.load(sin_ptr + token * stride_sin_t + lo * stride_sin_d, mask=lo_mask)
        cos = cos.to(dtype).to(tl.float32)
        sin = sin.to(dtype).to(tl.float32)
        q_mask = (heads < num_q_heads) & lo_mask  # q is rotated for every token, slot -1 or not
        q_in = q_ptr + token * stride_qt + heads * stride_qh
        q1, q2 = _rotate(tl.load(q_in + lo, mask=q_mask), tl.load(q_in + lo + HALF, mask=q_mask), cos, sin)
        q_out = q_out_ptr + token * stride_q_out_t + heads * stride_q_out_h
        tl.store(q_out + lo, q1, mask=q_mask)
        tl.store(q_out + lo + HALF, q2, mask=q_mask)
        k1, k2 = _rotate(k1, k2, cos, sin)
    if WRITE_KV:
        v_in = v_ptr + token * stride_vt + heads * stride_vh
        v1 = tl.load(v_in + lo * stride_vd, mask=kv_mask)
        v2 = tl.load(v_in + (lo + HALF) * stride_vd, mask=kv_mask)
        k_scale = 1.0
        v_scale = 1.0
        if QUANTIZED:
            k_scale = tl.load(k_scale_ptr)  # [1] float32 each
            v_scale = tl.load(v_scale_ptr)
        tl.store(k_cache_ptr + cache_offsets + lo, _to_cache(k1, k_scale, k_cache_ptr, QUANTIZED), mask=kv_mask)
        tl.store(k_cache_ptr + cache_offsets + lo + HALF, _to_cache(k2, k_scale, k_cache_ptr, QUANTIZED),
                 mask=kv_mask)
        tl.store(v_cache_ptr + cache_offsets + lo, _to_cache(v1, v_scale, v_cache_ptr, QUANTIZED), mask=kv_mask)
        tl.store(v_cache_ptr + cache_offsets + lo + HALF, _to_cache(v2, v_scale, v_cache_ptr, QUANTIZED),
                 mask=kv_mask)
    else:
        k_out = k_out_ptr + token * stride_k_out_t + heads * stride_k_out_h
        tl.store(k_out + lo, k1, mask=kv_mask)
        tl.store(k_out + lo + HALF, k2, mask=kv_mask)
    if REST > 0:  # partial rotary: the dims after the rotated ones, unchanged
        rest = 2 * HALF + tl.arange(0, BLOCK_REST)[None, :]  # [1, BLOCK_REST]
        rest_mask = rest < 2 * HALF + REST
        kv_rest = kv_heads & rest_mask
        k3 = tl.load(k_in + rest * stride_kd, mask=kv_rest)
        if ROTATE:
            q_rest = (heads < num_q_heads) & rest_mask
            tl.store(q_out + rest, tl.load(q_in + rest, mask=q_rest), mask=q_rest)
        if WRITE_KV:
            v3 = tl.load(v_in + rest * stride_vd, mask=kv_rest)
            tl.store(k_cache_ptr + cache_offsets + rest, _to_cache(k3, k_scale, k_cache_ptr, QUANTIZED),
                     mask=kv_rest)
            tl.store(v_cache_ptr + cache_offsets + rest, _to_cache(v3, v_scale, v_cache_ptr, QUANTIZED),
                     mask=kv_rest)
        else:
            tl.store(k_out + rest, k3, mask=kv_rest)


def _launch(k: Tensor, *, q: Tensor | None = None, q_out: Tensor | None = None, cos: Tensor | None = None,
            sin: Tensor | None = None, k_out: Tensor | None = None, v: Tensor | None = None,
            k_cache: Tensor | None = None, v_cache: Tensor | None = None,
            slot_mapping: Tensor | None = None, k_scale: Tensor | None = None,
            v_scale: Tensor | None = None) -> None:
    """Rotates when q is given; writes k, v to the caches when k_cache is given, else the rotated k to k_out.

    q, q_out: [T, Hq, D]; k, v, k_out: [T, Hk, D]; cos, sin: [T, R/2] (R < D: partial rotary); caches:
    [N, block_size, Hk, D], contiguous; slot_mapping: [T] int64; k_scale, v_scale: [1] float32 for a quantized cache, else None.
    """
    rotate, write_kv, quantized = q is not None, k_cache is not None, k_scale is not None
    tokens, num_kv_heads, head_dim = k.shape
    num_q_heads = q.shape[1] if rotate else 0
    if tokens == 0:
        return
    half = cos.shape[1] if rotate else head_dim // 2  # half the rotated dims (write only: half the head)
    rest = head_dim - 2 * half
    # The tensors a mode does not use are never dereferenced (the switches are compile-time): k stands in.
    q, q_out, cos, sin, k_out, v, k_cache, v_cache, slot_mapping, k_scale, v_scale = (
        t if t is not None else k
        for t in (q, q_out, cos, sin, k_out, v, k_cache, v_cache, slot_mapping, k_scale, v_scale))
    block_half = triton.next_power_of_2(half)
    max_heads = max(num_q_heads, num_kv_heads)
    block_h = min(triton.next_power_of_2(max_heads), max(1, _ELEMENTS_PER_PROGRAM // block_half))
    grid = (tokens, triton.cdiv(max_heads, block_h))
    _rotary_kv_kernel[grid](
        q, k, v, cos, sin, q_out, k_out, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        num_q_heads, num_kv_heads,
        q.stride(0), q.stride(1), *k.stride(), *v.stride(),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        HALF=half, BLOCK_HALF=block_half, REST=rest, BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
        BLOCK_H=block_h, ROTATE=rotate, WRITE_KV=write_kv,
        QUANTIZED=quantized, num_warps=4,
        # In float32 a fused multiply-add would skip the product's rounding that the reference does.
        enable_fp_fusion=False,
    )


def rotary_embedding_triton(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """kiln::rotary_embedding on CUDA: q: [T, Hq, D], k: [T, Hk, D] -> new rotated (q, k)."""
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _launch(k, q=q, q_out=q_out, cos=cos, sin=sin, k_out=k_out)
    return q_out, k_out


def write_kv_cache_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                          k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    """kiln::write_kv_cache on CUDA: k, v: [T, Hk, D] into the caches at slot_mapping: [T] (-1 skips); a
    float8_e4m3fn or int8 cache stores k / k_scale, v / v_scale (scales: [1] float32 on the device)."""
    _launch(k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, k_scale=k_scale,
            v_scale=v_scale)


def rotary_embedding_and_write_kv_triton(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                                         k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                                         k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """kiln::rotary_embedding_and_write_kv on CUDA: returns the rotated q; caches the rotated k and v (divided
    by k_scale, v_scale for a quantized cache, as write_kv_cache_triton)."""
    q_out = torch.empty_like(q)
    _launch(k, q=q, q_out=q_out, cos=cos, sin=sin, v=v, k_cache=k_cache, v_cache=v_cache,
            slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q_out
