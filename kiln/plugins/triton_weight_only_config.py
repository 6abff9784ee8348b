"""Launch settings of the weight-only GEMM (triton_weight_only.py), from shapes only: the tile, K-step and
split-K heuristic, the tuned settings' shape keys and candidates (builder/tune.py times them), which launches
take the INT4 group step, and from how many tokens the weight is dequantized whole instead. Never from
tensor values, so CUDA graphs capture and replay every launch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class _LaunchConfig:
    """One launch of _weight_only_kernel (and, split, _sum_splits_kernel) in triton_weight_only.py."""

    block_m: int  # tokens per tile: a power of two >= 16 (tl.dot's minimum)
    block_n: int  # output features per tile
    block_k: int  # input features per loop step: a power of two >= 16
    group_aligned: bool  # every step lies in one group: one scale per row a step
    split_k: int  # K ranges summed by _sum_splits_kernel; 1 writes y directly
    k_per_split: int  # a multiple of block_k
    num_warps: int
    num_stages: int


# Tokens from which the weight is dequantized whole (triton_dequantize.py) and multiplied by cuBLAS: the
# fused kernel dequantizes every tile in its inner loop, right while the product is bound by the
# weight's bytes, slower than cuBLAS's tensor-core GEMM once it is compute-bound. On an H100 at the
# Llama-3.1-8B shapes (INT4, g128, CUDA-graph timed) the fused kernel wins up to 512 tokens (N=28672: 446 us
# against 704 at 512; 1681 against 1153 at 2048) and they cross near 1024: decode batches stay fused, long
# prefill chunks go to cuBLAS. Measured before the dequantization kernel became 3x faster (triton_dequantize.py):
# the crossover is likely lower now (a layer at 512 tokens: 894 us fused against 356 us of dequantization plus
# the GEMMs), not yet timed. Its parts twin (triton_weight_only_parts.py) goes by the same bound.
DEQUANT_MIN_TOKENS = 1024
_MAX_BLOCK_K = 128
# INT4 steps inside one group go through _int4_group_step; False makes them dequantize (benchmarks compare).
# Only for one token: on an H100 (8B shapes, CUDA-graph timed, best of a grid of tiles, splits and warps) it
# is 2% faster at one token (the four GEMMs of a layer 103 us against 105), 25% slower at 16 (137 against
# 110) and 2.5-7x slower from 32 tokens, where the per-group partial sum beside the accumulator costs more
# than it saves (gate_up at 128 tokens: 778 us against 158).
INT4_FAST = True
_INT4_FAST_MAX_TOKENS = 1
_MIN_STEPS_PER_SPLIT = 4  # shorter K ranges cost more in partial traffic than their parallelism brings
_MAX_SPLIT_K = 16


def _block_m(t: int) -> int:
    return 16 if t <= 16 else min(triton.next_power_of_2(t), 128)


def config_with(t: int, k: int, group_size: int, has_g_idx: bool, *, block_n: int, block_k: int, split_k: int,
                num_warps: int, num_stages: int) -> _LaunchConfig:
    """A launch with these settings (tuned or heuristic) for T tokens and K input features: the K ranges
    rounded to whole steps (no empty split), steps inside one group where block_k allows it."""
    group_aligned = not has_g_idx and block_k <= group_size and group_size % block_k == 0
    k_steps = triton.cdiv(k, block_k)
    steps_per_split = triton.cdiv(k_steps, max(1, min(split_k, k_steps)))
    split_k = triton.cdiv(k_steps, steps_per_split)
    return _LaunchConfig(_block_m(t), block_n, block_k, group_aligned, split_k, steps_per_split * block_k,
                         num_warps, num_stages)


def _launch_config(t: int, n: int, k: int, bits: int, group_size: int, has_g_idx: bool,
                   num_sms: int) -> _LaunchConfig:
    """Tile sizes, group alignment and split-K from shapes only (never tensor values: CUDA graphs replay).
    Timed on an H100 at the Llama-3.1-8B shapes, decode wants wide N tiles and about 8 K ranges (0.7-0.9 TB/s
    with 64-wide tiles and K split to fill the SMs once, 0.8-1.2 TB/s so); an engine built for a GPU replaces
    this with the winners timed there (tuning_key, builder/tune.py)."""
    block_m = _block_m(t)
    decode = block_m <= 32  # memory-bound: stream long K steps through few rows
    block_n = 128 if decode else (64 if block_m <= 64 else 128)
    # The largest power of two up to the cap that divides group_size keeps every step in one group.
    cap = _MAX_BLOCK_K if decode else 64
    block_k = min(cap, group_size & -group_size)
    if has_g_idx or block_k < 16:
        block_k = cap
    tiles = triton.cdiv(t, block_m) * triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    split_k = 1
    if tiles < 8 * num_sms:  # too few tiles to keep every SM streaming: spread K over more programs
        # The float32 partials (split_k * T * N * 4 bytes, written and read back) stay within the weight's
        # own bytes (N * K * bits / 8): decode splits freely, a 128-token prefill only a little.
        traffic_cap = k * bits // (32 * t)
        split_k = max(1, min(triton.cdiv(8 * num_sms, tiles), k_steps // _MIN_STEPS_PER_SPLIT, _MAX_SPLIT_K,
                             traffic_cap, 8))
    num_warps = 4 if block_m * block_n <= 64 * 128 or decode else 8
    return config_with(t, k, group_size, has_g_idx, block_n=block_n, block_k=block_k, split_k=split_k,
                       num_warps=num_warps, num_stages=3)


TUNED_KERNEL = "weight_only_linear"  # its name in target.kernel_settings


def tuning_key(t: int, n: int, k: int, bits: int, group_size: int, has_g_idx: bool, has_zeros: bool) -> str:
    """The shape key of a launch in the tuning table: tokens by tile height (launches of one block_m share
    their compiled kernel and their best settings), then the weight's shape and format."""
    return (f"m{_block_m(t)}_n{n}_k{k}_int{bits}{'_zp' if has_zeros else ''}_g{group_size}"
            f"{'_act' if has_g_idx else ''}")


def tuning_candidates() -> tuple[list[dict], Callable[[dict], list[dict]]]:
    """What build-time tuning (builder/tune.py) times, in two rounds: tiles and K ranges at one warp count and
    pipeline depth, then warps and depths around the best of those; settings as config_with takes them."""
    first = [{"block_n": bn, "block_k": bk, "split_k": split, "num_warps": 4, "num_stages": 3}
             for bn in (64, 128, 256) for bk in (64, 128) for split in (1, 2, 4, 8, 16, 32)]

    def second(best: dict) -> list[dict]:
        return [{**best, "num_warps": w, "num_stages": st} for w in (2, 4, 8) for st in (2, 3, 4)]
    return first, second


def _int4_fast(cfg: _LaunchConfig, bits: int, t: int) -> bool:
    """Whether this launch takes _int4_group_step: INT4, one token, K steps that stay inside one group."""
    return (INT4_FAST and bits == 4 and cfg.group_aligned and cfg.block_k >= 32
            and t <= _INT4_FAST_MAX_TOKENS)
