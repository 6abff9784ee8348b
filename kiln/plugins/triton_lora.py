"""Triton kernels behind kiln::lora_add on CUDA: Punica's BGMV as two launches a linear, shrink then expand.

- shrink, grid (T, splits): program (t, c) multiplies x[t]'s K chunk c by a[slot[t]] ([P*R, chunk]: every
  part's A at once) and stores the float32 partial [P*R] at partial[t, c]. Splitting K lets one row use many
  SMs (batch 1).
- expand, grid (T, blocks): the N blocks are laid out part by part (each part's columns cut into BLOCK_N
  blocks, its last one masked), so no block straddles a part end and a block's part is a scalar. Program
  (t, j) sums row t's partials of its part's R values, multiplies by scale[slot[t]] and by the block's rows of
  b[slot[t]] ([BLOCK_N, R]), adds to y[t] in float32 and rounds once to y's dtype.

A linear of P parts (q/k/v, gate/up) is one shrink and one expand: 8 launches a decoder layer (qkv, o,
gate_up, down) where a call per part took 14. The expand finds its block's part from at most _MAX_PARTS parts'
bounds passed as scalars; a linear of more parts (no kiln model has one) gets one expand per group of
_MAX_PARTS parts.

Two launches, not one: fusing them would make every N block redo the whole shrink (R x K reads of a per
block) or need a grid-wide sync; the float32 partials in between are T x splits x P*R floats, a few KiB. The
partials are summed by the expand in a fixed order, so results do not depend on scheduling (no atomics).

CUDA-graph safe: the grids, the part bounds and the partial buffer depend on shapes only; slots and scales
are read on the device; a row whose slot is -1 (or out of [0, S)) returns at once in both kernels and leaves
y's row as is. Rows are matrix-vector products (tl.sum of a broadcast product, no tensor cores): the kernels
are bound by reading a and b, or, with no adapter in use, by the launches. See lora.py for what limits them.
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
# The parts one expand launch covers (q, k, v): their bounds are scalar arguments.
_MAX_PARTS = 3


@triton.jit
def _slot_of(slot_ptr, row, num_slots):
    """The row's slot as int64, and whether the row has an adapter (a slot in [0, S))."""
    s = tl.load(slot_ptr + row).to(tl.int64)
    return s, (s >= 0) & (s < num_slots)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slot_ptr, partial_ptr,
    num_slots, rows_a, k_size, k_per_split, splits,
    stride_xt, stride_as, stride_ar,
    BLOCK_PR: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    s, has_adapter = _slot_of(slot_ptr, row, num_slots)
    if has_adapter:
        r = tl.arange(0, BLOCK_PR)
        r_mask = r < rows_a
        a_rows = a_ptr + s * stride_as + r[:, None] * stride_ar  # [BLOCK_PR, 1]
        start = chunk * k_per_split
        acc = tl.zeros([BLOCK_PR], dtype=tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            k = start + k0 + tl.arange(0, BLOCK_K)
            k_mask = k < k_size
            xv = tl.load(x_ptr + row * stride_xt + k, mask=k_mask, other=0.0).to(tl.float32)
            av = tl.load(a_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(partial_ptr + (row * splits + chunk) * rows_a + r, acc, mask=r_mask)


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, slot_ptr, scale_ptr, partial_ptr,
    num_slots, rank, n_size, splits, rows_a, r_offset,
    block1, col1, block2, col2,
    stride_yt, stride_bs, stride_bn,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Parts 1 and 2 begin at column col1 and col2 and own the blocks from block1 and block2 on (a missing
    part: its column N, its block past the grid); part p's R values of a row's shrink start at
    r_offset + p*R."""
    row = tl.program_id(0).to(tl.int64)
    s, has_adapter = _slot_of(slot_ptr, row, num_slots)
    if has_adapter:
        j = tl.program_id(1)
        in1 = j >= block1
        in2 = j >= block2
        first_block = tl.where(in2, block2, tl.where(in1, block1, 0))
        start = tl.where(in2, col2, tl.where(in1, col1, 0))
        end = tl.where(in2, n_size, tl.where(in1, col2, col1))
        part_r = r_offset + (in1.to(tl.int32) + in2.to(tl.int32)) * rank
        r = tl.arange(0, BLOCK_R)
        r_mask = r < rank
        shrunk = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c in range(0, splits):  # in order: the same sum whatever the scheduling
            shrunk += tl.load(partial_ptr + (row * splits + c) * rows_a + part_r + r, mask=r_mask, other=0.0)
        shrunk = shrunk * tl.load(scale_ptr + s)
        n = start + (j - first_block) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < end
        bv = tl.load(b_ptr + s * stride_bs + n[:, None] * stride_bn + r[None, :],
                     mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(bv * shrunk[None, :], axis=1)  # [BLOCK_N]
        y_row = y_ptr + row * stride_yt + n
        yv = tl.load(y_row, mask=n_mask, other=0.0)
        tl.store(y_row, (yv.to(tl.float32) + delta).to(yv.dtype), mask=n_mask)


def _clamp_pow2(value: int, low: int, high: int) -> int:
    return max(low, min(high, triton.next_power_of_2(max(1, value))))


def launch_settings(tokens: int, n: int, k: int, rank: int, sms: int, parts: int = 1) -> dict[str, int]:
    """BLOCK_PR, BLOCK_K, k_per_split, splits (shrink), BLOCK_R and BLOCK_N (expand) for these shapes (n: all
    parts' columns): enough programs to cover the SMs twice when the rows alone do not (batch 1), tiles of at
    most _TILE elements.

    The block sizes are compile-time: BLOCK_K depends on the rank and parts only and BLOCK_N takes one of
    three values, so capturing CUDA graphs for every batch size compiles a few variants, not one per size; the
    batch size moves k_per_split and splits, which are runtime values."""
    block_pr = max(16, triton.next_power_of_2(parts * rank))
    block_k = max(_MIN_BLOCK, min(max(_MIN_BLOCK, _TILE // block_pr), 128, triton.next_power_of_2(k)))
    block_r = max(16, triton.next_power_of_2(rank))
    widest_n = max(_MIN_BLOCK, _TILE // block_r)
    split_target = min(_MAX_SPLITS, triton.cdiv(2 * sms, tokens))
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split_target) * block_k
    block_n = _clamp_pow2(triton.cdiv(n * tokens, 4 * sms), _MIN_BLOCK,
                          max(_MIN_BLOCK, min(widest_n, 256, triton.next_power_of_2(n))))
    return dict(BLOCK_PR=block_pr, BLOCK_K=block_k, k_per_split=k_per_split,
                splits=triton.cdiv(k, k_per_split), BLOCK_R=block_r, BLOCK_N=block_n)


def _expand(y: torch.Tensor, lora_b: torch.Tensor, slot: torch.Tensor, scale: torch.Tensor,
            partial: torch.Tensor, sizes: list[int], r_offset: int, cfg: dict[str, int]) -> None:
    """One expand launch over y's columns (and lora_b's rows) of at most _MAX_PARTS parts of these sizes."""
    block_n = cfg["BLOCK_N"]
    counts = [triton.cdiv(size, block_n) for size in sizes]
    blocks = [sum(counts[:i]) for i in range(len(sizes) + 1)]  # each part's first block, then the total
    cols = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    missing = _MAX_PARTS - len(sizes)  # a missing part begins at column N and past the last block
    block1, block2 = (blocks[1:-1] + [blocks[-1]] * missing)[:2]
    col1, col2 = (cols[1:-1] + [cols[-1]] * missing)[:2]
    tokens, n = y.shape
    num_slots, _, rank = lora_b.shape
    _expand_kernel[(tokens, blocks[-1])](
        y, lora_b, slot, scale, partial,
        num_slots, rank, n, partial.shape[1], partial.shape[2], r_offset,
        block1, col1, block2, col2,
        y.stride(0), lora_b.stride(0), lora_b.stride(1),
        BLOCK_R=cfg["BLOCK_R"], BLOCK_N=block_n, num_warps=4,
    )


def launch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slot: torch.Tensor,
           scale: torch.Tensor, part_ends: list[int], settings: dict[str, int] | None = None) -> None:
    """Runs shrink then expand (one per _MAX_PARTS parts); `settings` overrides `launch_settings` (the tests
    force several K chunks per split and ragged blocks at small shapes)."""
    tokens, n = y.shape
    num_slots, rows_a, k = lora_a.shape
    rank, parts = lora_b.shape[2], len(part_ends)
    if tokens == 0:
        return
    cfg = settings or launch_settings(tokens, n, k, rank, sm_count(y.device), parts)
    splits = cfg["splits"]
    partial = torch.empty(tokens, splits, rows_a, device=y.device, dtype=torch.float32)
    _shrink_kernel[(tokens, splits)](
        x, lora_a, slot, partial,
        num_slots, rows_a, k, cfg["k_per_split"], splits,
        x.stride(0), lora_a.stride(0), lora_a.stride(1),
        BLOCK_PR=cfg["BLOCK_PR"], BLOCK_K=cfg["BLOCK_K"], num_warps=4,
    )
    starts = [0, *part_ends[:-1]]
    for first in range(0, parts, _MAX_PARTS):
        last = min(first + _MAX_PARTS, parts)
        cols = slice(starts[first], part_ends[last - 1])
        _expand(y[:, cols], lora_b[:, cols], slot, scale, partial,
                [part_ends[p] - starts[p] for p in range(first, last)], first * rank, cfg)


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    slot: torch.Tensor, scale: torch.Tensor, part_ends: list[int]) -> None:
    """kiln::lora_add on CUDA (semantics and checks: plugins/lora.py): one shrink over every part's A, then
    one expand whose N blocks each lie in one part."""
    launch(y, x, lora_a, lora_b, slot, scale, part_ends)
