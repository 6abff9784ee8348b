"""Triton kernels behind kiln::lora_add on CUDA: Punica's BGMV as two launches, shrink then expand.

- shrink, grid (T, splits): program (t, c) multiplies x[t]'s K chunk c by a[slot[t]] ([R, chunk]) and stores
  the float32 partial [R] at partial[t, c]. Splitting K lets one row use many SMs (batch 1).
- expand, grid (T, cdiv(N, BLOCK_N)): program (t, j) sums row t's partials, multiplies by scale[slot[t]] and
  by the N block j of b[slot[t]] ([BLOCK_N, R]), adds to y[t] in float32 and rounds once to y's dtype.

Two launches, not one: fusing them would make every N block redo the whole shrink (R x K reads of a per
block) or need a grid-wide sync; the float32 partials in between are T x splits x R floats, a few KiB. The
partials are summed by the expand in a fixed order, so results do not depend on scheduling (no atomics).

CUDA-graph safe: the grids and the partial buffer depend on shapes only; slots and scales are read on the
device; a row whose slot is -1 (or out of [0, S)) returns at once in both kernels and leaves y's row as is.
Rows are matrix-vector products (tl.sum of a broadcast product, no tensor cores): the kernels are bound by
reading a and b. See lora.py for what limits them at batch 1 and 64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import sm_count

# Elements of a's or b's tile a program holds at once: float32 products of 64 registers a thread at 4 warps.
_TILE = 8192
# The shrink splits K into at most this many chunks: the expand sums that many partials per program.
_MAX_SPLITS = 64
# The narrowest K chunk or N block: 32 elements keep a row's reads 64-byte wide in 16-bit dtypes.
_MIN_BLOCK = 32


@triton.jit
def _slot_of(slot_ptr, row, num_slots):
    """The row's slot as int64, and whether the row has an adapter (a slot in [0, S))."""
    s = tl.load(slot_ptr + row).to(tl.int64)
    return s, (s >= 0) & (s < num_slots)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slot_ptr, partial_ptr,
    num_slots, rank, k_size, k_per_split, splits,
    stride_xt, stride_as, stride_ar,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    s, has_adapter = _slot_of(slot_ptr, row, num_slots)
    if has_adapter:
        r = tl.arange(0, BLOCK_R)
        r_mask = r < rank
        a_rows = a_ptr + s * stride_as + r[:, None] * stride_ar  # [BLOCK_R, 1]
        start = chunk * k_per_split
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            k = start + k0 + tl.arange(0, BLOCK_K)
            k_mask = k < k_size
            xv = tl.load(x_ptr + row * stride_xt + k, mask=k_mask, other=0.0).to(tl.float32)
            av = tl.load(a_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(partial_ptr + (row * splits + chunk) * rank + r, acc, mask=r_mask)


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, slot_ptr, scale_ptr, partial_ptr,
    num_slots, rank, n_size, splits,
    stride_yt, stride_bs, stride_bn,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s, has_adapter = _slot_of(slot_ptr, row, num_slots)
    if has_adapter:
        r = tl.arange(0, BLOCK_R)
        r_mask = r < rank
        shrunk = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c in range(0, splits):  # in order: the same sum whatever the scheduling
            shrunk += tl.load(partial_ptr + (row * splits + c) * rank + r, mask=r_mask, other=0.0)
        shrunk = shrunk * tl.load(scale_ptr + s)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < n_size
        bv = tl.load(b_ptr + s * stride_bs + n[:, None] * stride_bn + r[None, :],
                     mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(bv * shrunk[None, :], axis=1)  # [BLOCK_N]
        y_row = y_ptr + row * stride_yt + n
        yv = tl.load(y_row, mask=n_mask, other=0.0)
        tl.store(y_row, (yv.to(tl.float32) + delta).to(yv.dtype), mask=n_mask)


def _clamp_pow2(value: int, low: int, high: int) -> int:
    return max(low, min(high, triton.next_power_of_2(max(1, value))))


def launch_settings(tokens: int, n: int, k: int, rank: int, sms: int) -> dict[str, int]:
    """BLOCK_R, BLOCK_K, k_per_split, splits (shrink) and BLOCK_N (expand) for these shapes: enough programs
    to cover the SMs twice when the rows alone do not (batch 1), tiles of at most _TILE elements.

    The block sizes are compile-time: BLOCK_K depends on the rank only and BLOCK_N takes one of three values,
    so capturing CUDA graphs for every batch size compiles a few variants, not one per size; the batch size
    moves k_per_split and splits, which are runtime values."""
    block_r = max(16, triton.next_power_of_2(rank))
    widest = max(_MIN_BLOCK, _TILE // block_r)
    block_k = max(_MIN_BLOCK, min(widest, 128, triton.next_power_of_2(k)))
    split_target = min(_MAX_SPLITS, triton.cdiv(2 * sms, tokens))
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split_target) * block_k
    block_n = _clamp_pow2(triton.cdiv(n * tokens, 4 * sms), _MIN_BLOCK,
                          max(_MIN_BLOCK, min(widest, 256, triton.next_power_of_2(n))))
    return dict(BLOCK_R=block_r, BLOCK_K=block_k, k_per_split=k_per_split,
                splits=triton.cdiv(k, k_per_split), BLOCK_N=block_n)


def launch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slot: torch.Tensor,
           scale: torch.Tensor, settings: dict[str, int] | None = None) -> None:
    """Runs shrink then expand; `settings` overrides `launch_settings` (the tests force several K chunks per
    split and ragged blocks at small shapes)."""
    tokens, n = y.shape
    num_slots, rank, k = lora_a.shape
    if tokens == 0:
        return
    cfg = settings or launch_settings(tokens, n, k, rank, sm_count(y.device))
    splits = cfg["splits"]
    partial = torch.empty(tokens, splits, rank, device=y.device, dtype=torch.float32)
    _shrink_kernel[(tokens, splits)](
        x, lora_a, slot, partial,
        num_slots, rank, k, cfg["k_per_split"], splits,
        x.stride(0), lora_a.stride(0), lora_a.stride(1),
        BLOCK_R=cfg["BLOCK_R"], BLOCK_K=cfg["BLOCK_K"], num_warps=4,
    )
    _expand_kernel[(tokens, triton.cdiv(n, cfg["BLOCK_N"]))](
        y, lora_b, slot, scale, partial,
        num_slots, rank, n, splits,
        y.stride(0), lora_b.stride(0), lora_b.stride(1),
        BLOCK_R=cfg["BLOCK_R"], BLOCK_N=cfg["BLOCK_N"], num_warps=4,
    )


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    slot: torch.Tensor, scale: torch.Tensor) -> None:
    """kiln::lora_add on CUDA: y[t] += scale[s] * (x[t] @ lora_a[s].T) @ lora_b[s].T for s = slot[t] >= 0."""
    launch(y, x, lora_a, lora_b, slot, scale)
