"""Batched multi-LoRA: adds each token row's adapter product to a linear's output, in place.

    y[t, n] += scale[s] * (x[t] @ lora_a[s, p*R:(p+1)*R].T) @ lora_b[s, n].T    for s = slot[t] >= 0,
                                                                                p the part column n is in

A fused linear ([q; k; v], [gate; up]) has P parts, each with its own adapter pair: `part_ends` (P ints, the
columns where each part of y ends, static shape data) splits y's N columns into them, lora_a stacks the
parts' A ([S, P*R, K]: one shrink gives a row's P*R values at once) and lora_b holds every column's B row
([S, N, R]), which multiplies its part's R values of the shrink. One call covers a whole linear: on CUDA
that is two launches a linear, whatever its parts. P = 1 (part_ends [N]) is the plain case.

The adapters sit in S device slots, each zero-padded to the largest rank R (a zero rank row adds nothing;
a part an adapter does not touch is all zeros), so one batch mixes rows of any adapters and of the base
model, as Punica's BGMV does. The products accumulate in float32: the shrink x @ a^T and its scaling stay in
float32, and y is read, added to and rounded to its dtype once. `y` may be a column slice of a wider output:
any row stride, last dim contiguous.

The reference (the CPU's) groups the rows by slot and runs a shrink matmul and one expand matmul per part
per adapter present; it reads the slots on the host, so where it runs on CUDA (KILN_DISABLE_TRITON=1) it
syncs and cannot be captured in a CUDA graph. The Triton kernel (triton_lora.py) can: a shrink kernel per
(row, K chunk) writes float32 partial products of x @ a^T (all P*R of them), an expand kernel per (row, N
block of one part) sums its part's, scales, multiplies by b and adds to y. Its grid depends on shapes only,
and a row with slot -1 returns at once.

Performance: inside CUDA graphs the launches are what `--enable-lora` costs when no row uses an adapter (an
H200, 8B bf16, batch-64 engine: one call per part, 14 launches a layer, took batch-1 decode from 213.9 to
190.6 tok/s, -11%, and 128/128 throughput from 9127 to 8291 tok/s, -9%); one call per linear makes it 8
launches a layer (qkv, o, gate_up, down: shrink + expand each). Not yet re-measured. With adapters in use
both kernels are matrix-vector products per row, memory-bound, reading x, a[s] (P*R x K) and b[s] (N x R).
At batch 1 the bytes are tiny (an 8B layer's qkv at rank 16: 384 KiB of a and 192 KiB of b in bf16), so
the cost is the launches (a few microseconds each) and how many SMs share the reads: the shrink splits K (32
programs for K = 4096) and the expand splits N (hundreds of programs for N = 6144), so one row spreads over
a good part of an H100's SMs. At batch 64 every row re-reads its adapter's a and b, from L2 rather than HBM
when rows share adapters; the per-row products use no tensor cores, so for long prefills (hundreds of rows
per adapter) an SGMV-style kernel (rows sorted by slot, tensor-core tiles per segment) would beat this BGMV
one. The launch settings are heuristics (triton_lora.launch_settings), not yet tuned. On the CPU the
reference costs a few small matmuls per adapter present: at T = 16, K = N = 2048, rank 16, one part, one
thread, 0.2 ms for one adapter and 0.5 ms for four beside a 3 ms base matmul (float32), nothing when every
row is -1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._checks import FLOAT_DTYPES, check_dims, check_dtype, check_same_device, check_size
from ._eager import runs_reference_directly
from ._spec import OpSpec, define


def part_bounds(part_ends: Sequence[int]) -> list[tuple[int, int]]:
    """Each part's [start, end) columns of y."""
    return list(zip([0, *part_ends[:-1]], part_ends))


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       slot: torch.Tensor, scale: torch.Tensor, part_ends: list[int]) -> None:
    if y.shape[0] == 0:
        return
    rank = lora_b.shape[2]
    # One shrink and one expand per part per adapter present, over its rows gathered: no loop over rows.
    for s in torch.unique(slot).tolist():
        if s < 0:
            continue
        rows = (slot == s).nonzero().squeeze(1)
        shrunk = (x.index_select(0, rows).float() @ lora_a[s].float().T) * scale[s]  # [rows, P*R] float32
        added = y.index_select(0, rows).float()
        for p, (start, end) in enumerate(part_bounds(part_ends)):
            added[:, start:end] += shrunk[:, p * rank:(p + 1) * rank] @ lora_b[s, start:end].float().T
        y.index_copy_(0, rows, added.to(y.dtype))


def _lora_add_fake(y, x, lora_a, lora_b, slot, scale, part_ends):
    return None


LORA_ADD = OpSpec("kiln::lora_add", """
    Tensor(a!) y        [T, N] float32 / float16 / bfloat16, last dim contiguous, any row stride; added to
    Tensor x            [T, K] y's dtype, last dim contiguous
    Tensor lora_a       [S, P*R, K] y's dtype, last dim contiguous: each slot's A, R rows a part in order
    Tensor lora_b       [S, N, R] y's dtype, last dim contiguous: each slot's B, columns past its rank zero
    Tensor slot         [T] int32: the row's slot in [0, S), or -1 for none
    Tensor scale        [S] float32: each slot's scaling (alpha / rank, or alpha / sqrt(rank))
    SymInt[] part_ends  [P] increasing: where each part's columns of y end, the last N
    -> ()
    """, reference=lora_add_reference, fake=_lora_add_fake, kernel="triton_lora.lora_add_triton")
_lora_add = define(LORA_ADD)


def _check_part_ends(part_ends: Sequence[int], n: int, a_rows: int) -> int:
    """The checked parts' rank R (lora_a's rows per part)."""
    ends = list(part_ends)
    if (not ends or any(type(e) is not int for e in ends) or ends[-1] != n
            or any(end <= start for start, end in part_bounds(ends))):
        raise ValueError(f"part_ends {ends} must be the P >= 1 increasing column ends of y's parts, the last "
                         f"y's width N={n}")
    if a_rows % len(ends):
        raise ValueError(f"lora_a has {a_rows} rows (dim 1), not a multiple of the {len(ends)} parts in "
                         f"part_ends {ends}: it stacks R rows per part")
    return a_rows // len(ends)


def _check(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slot: torch.Tensor,
           scale: torch.Tensor, part_ends: Sequence[int]) -> None:
    for name, t, ndim in (("y", y, 2), ("x", x, 2), ("lora_a", lora_a, 3), ("lora_b", lora_b, 3),
                          ("slot", slot, 1), ("scale", scale, 1)):
        check_dims(name, t, ndim)
    check_dtype("y", y, FLOAT_DTYPES)
    for name, t in (("x", x), ("lora_a", lora_a), ("lora_b", lora_b)):
        check_dtype(name, t, (y.dtype,))
    check_dtype("slot", slot, (torch.int32,))
    check_dtype("scale", scale, (torch.float32,))
    tokens, n = y.shape
    slots, a_rows, k = lora_a.shape
    rank = _check_part_ends(part_ends, n, a_rows)
    check_size("x", x, 0, tokens, "rows of y")
    check_size("slot", slot, 0, tokens, "rows of y")
    check_size("lora_a", lora_a, 2, x.shape[1], "input width K of x")
    check_size("lora_b", lora_b, 0, slots, "slots S of lora_a")
    check_size("lora_b", lora_b, 1, n, "output width N of y")
    check_size("lora_b", lora_b, 2, rank, "rank R: lora_a's rows per part")
    check_size("scale", scale, 0, slots, "slots S of lora_a")
    if rank == 0 or slots == 0:
        raise ValueError(f"lora_a has shape {tuple(lora_a.shape)}: it needs at least one slot and rank 1")
    check_same_device(y=y, x=x, lora_a=lora_a, lora_b=lora_b, slot=slot, scale=scale)
    # Only the last dim must be contiguous: y may be a column slice of a wider output, lora_b a slice of a
    # stacked B.
    for name, t in (("y", y), ("x", x), ("lora_a", lora_a), ("lora_b", lora_b)):
        if t.numel() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slot: torch.Tensor,
             scale: torch.Tensor, part_ends: Sequence[int] | None = None) -> None:
    """Adds scale[s] * (x @ <part p's rows of lora_a[s]>.T) @ lora_b[s].T to part p's columns of each row of y
    whose slot s is not -1, in place, for every part p at once.

    y: [T, N] (a column slice of a wider output is fine); x: [T, K]; part_ends: the P parts' column ends in y,
    increasing, the last N (None: one part, [N]); lora_a: [S, P*R, K], part p's A in rows [p*R, (p+1)*R);
    lora_b: [S, N, R] (same float dtype, adapters of a smaller rank zero-padded to R); slot: [T] int32 in
    [-1, S); scale: [S] float32. On the CPU a slot out of range is refused; the GPU kernel, which reads the
    slots on the device only, skips such a row.
    """
    ends = [y.shape[1]] if part_ends is None else list(part_ends)
    _check(y, x, lora_a, lora_b, slot, scale, ends)
    if runs_reference_directly(y) and slot.numel():
        low, high = int(slot.min()), int(slot.max())
        if low < -1 or high >= lora_a.shape[0]:
            bad = low if low < -1 else high
            raise ValueError(f"slot holds {bad}: a row's slot must be -1 (no adapter) or in [0, "
                             f"{lora_a.shape[0]}) (S, the slots of lora_a)")
    _lora_add.for_tensor(y)(y, x, lora_a, lora_b, slot, scale, ends)
