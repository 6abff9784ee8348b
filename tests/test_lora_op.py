"""The batched multi-LoRA operator kiln::lora_add (plugins/lora.py, kernel plugins/triton_lora.py).

What must hold:
- CPU: the reference equals a naive loop over rows and parts with each adapter at its own rank (the padding
  to the largest rank adds nothing), for T = 0, 1, 257, all rows -1, one slot, many slots, ragged N, y a
  column slice of a wider output (the columns beside it and the rows with slot -1 untouched, bit for bit),
  one part and a fused layer's 2, 3 (unequal: q/k/v) and 4; one call for all parts equals a call per part.
- The wrapper refuses bad arguments naming them; the op itself works through the dispatcher and on meta.
- Triton's interpreter: the kernel gives the reference's result at tiny shapes (float32, float16; the
  interpreter truncates to bfloat16, so bfloat16 is checked on CUDA), with several K chunks per program,
  several splits, ragged blocks (in every part), strided y and lora_b, fused q/k/v and gate/up, 4 and 5
  parts (more than one expand launch).
- CUDA (gpu marker): the kernel against the reference at Llama-8B shapes, one part and fused (qkv, gate_up,
  a TP=8 rank's qkv), and inside a CUDA graph (one part and fused qkv) whose slots, scales and inputs change
  between replays.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from triton_interpret import needs_triton, run_interpreted

from kiln.plugins import lora_add
from kiln.plugins._triton import USE_TRITON
from kiln.plugins.lora import lora_add_reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- shared helpers (the interpreted and CUDA checks import this file too) ---


def make_case(t: int, n: int, k: int, ranks: list[int], dtype: torch.dtype, gen: torch.Generator,
              device: str = "cpu", slots: list[int] | None = None, pad: int = 0, parts: list[int] | None = None):
    """Adapters of the given ranks zero-padded to the largest R, rows' slots drawn from [-1, S) unless given,
    y a column slice [pad, pad + n) of a wider [t, n + 2 * pad] output. `parts`: the sizes of a fused layer's
    parts (adding up to n; None: one part); an adapter's odd parts get half its rank (ragged ranks within
    one adapter, as PEFT's rank_pattern gives), and lora_a stacks the parts' A ([S, P*R, K]). Values give
    products of about 1. Returns (y_full, y, x, lora_a, lora_b, slot, scale, adapters, part_ends) with
    adapters[s][p] = (a_sp, b_sp) unpadded."""
    sizes = parts or [n]
    assert sum(sizes) == n
    part_ends = [sum(sizes[:p + 1]) for p in range(len(sizes))]
    r_max = max(ranks)
    lora_a = torch.zeros(len(ranks), len(sizes) * r_max, k)
    lora_b = torch.zeros(len(ranks), n, r_max)
    adapters = []
    for s, rank in enumerate(ranks):
        adapters.append([])
        for p, size in enumerate(sizes):
            r = rank if p % 2 == 0 else max(1, rank // 2)
            a_sp = torch.randn(r, k, generator=gen) / k ** 0.5
            b_sp = torch.randn(size, r, generator=gen) / r ** 0.5
            lora_a[s, p * r_max:p * r_max + r] = a_sp
            lora_b[s, part_ends[p] - size:part_ends[p], :r] = b_sp
            adapters[s].append((a_sp.to(device, dtype), b_sp.to(device, dtype)))
    if slots is None:
        slot = torch.randint(-1, len(ranks), (t,), generator=gen, dtype=torch.int32)
    else:
        slot = torch.tensor(slots, dtype=torch.int32).reshape(t)
    scale = torch.rand(len(ranks), generator=gen) * 2 + 0.25
    x = torch.randn(t, k, generator=gen)
    y_full = torch.randn(t, n + 2 * pad, generator=gen)
    y_full, x, lora_a, lora_b = (v.to(device, dtype) for v in (y_full, x, lora_a, lora_b))
    return (y_full, y_full[:, pad:pad + n], x, lora_a, lora_b, slot.to(device), scale.to(device), adapters,
            part_ends)


def naive_lora_add(y, x, slot, scale, adapters) -> None:
    """Row by row and part by part with each adapter at its own rank: the definition the reference is checked
    against."""
    for t in range(y.shape[0]):
        s = int(slot[t])
        if s >= 0:
            deltas = [(x[t].float() @ a_sp.float().T) * scale[s] @ b_sp.float().T for a_sp, b_sp in adapters[s]]
            y[t] = (y[t].float() + torch.cat(deltas)).to(y.dtype)


def assert_lora_close(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor, slot: torch.Tensor,
                      pad: int, what: str) -> None:
    """Rows with an adapter within a couple of ulps of y's dtype (float32 sums in another order: in a 16-bit
    dtype that moves few elements' rounding); rows with slot -1 and the columns outside the slice equal to
    what they were, bit for bit."""
    eps = torch.finfo(got.dtype).eps
    n = got.shape[1] - 2 * pad
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * eps, atol=max(4 * eps, 1e-5), msg=what)
    if got.dtype != torch.float32:
        assert (got != want).sum().item() <= 2 + got.numel() // 50, f"{what}: too many elements differ"
    idle = slot.long() < 0
    assert torch.equal(got[idle], before[idle]), f"{what}: a row without an adapter changed"
    outside = torch.cat([got[:, :pad], got[:, pad + n:]], 1)
    assert torch.equal(outside, torch.cat([before[:, :pad], before[:, pad + n:]], 1)), f"{what}: outside the slice"


# --- CPU: the reference ---

QKV, GATE_UP = [32, 8, 8], [24, 24]  # Llama's q 4096 / k 1024 / v 1024 and gate / up, scaled down


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, n, k, ranks, slots, pad, parts", [
    (0, 24, 16, [4], None, 0, None),
    (1, 24, 16, [4, 8], [1], 0, None),
    (1, 24, 16, [4, 8], [-1], 3, None),
    (7, 37, 50, [8], [0] * 7, 5, None),  # one slot for every row, ragged N, a column slice
    (6, 33, 20, [2, 5, 8], [-1] * 6, 2, None),  # nothing to add
    (257, 45, 64, [16, 3, 8, 1, 11], None, 7, None),  # many slots, ragged ranks
    (9, 48, 40, [8, 16], [0, -1, 1, 1, 0, -1, -1, 1, 0], 2, QKV),  # fused q/k/v, ranks 8 and 16 padded
    (5, 48, 40, [16, 4, 8], None, 0, GATE_UP),
    (4, 31, 24, [6, 3], [1, 0, -1, 0], 1, [5, 7, 9, 10]),  # four ragged parts
])
def test_reference_matches_a_row_by_row_loop(dtype, t, n, k, ranks, slots, pad, parts):
    gen = torch.Generator().manual_seed(t * 1000 + n)
    y_full, y, x, lora_a, lora_b, slot, scale, adapters, ends = make_case(t, n, k, ranks, dtype, gen, slots=slots,
                                                                          pad=pad, parts=parts)
    before, want = y_full.clone(), y_full.clone()
    naive_lora_add(want[:, pad:pad + n], x, slot, scale, adapters)
    lora_add(y, x, lora_a, lora_b, slot, scale, None if parts is None else ends)
    assert_lora_close(y_full, want, before, slot, pad, f"T={t} {dtype} parts={parts}")
    if dtype == torch.float32:  # the padded ranks add exact zeros: float32 agrees to rounding
        torch.testing.assert_close(y_full, want, rtol=1e-5, atol=1e-5)


def test_one_call_for_all_parts_equals_one_call_per_part():
    """What the runtime did before (a call per part on its column slice) and does now (one call)."""
    gen = torch.Generator().manual_seed(5)
    y_full, y, x, lora_a, lora_b, slot, scale, _, ends = make_case(11, 48, 40, [16, 8, 16], torch.float32, gen,
                                                                   pad=3, parts=QKV)
    per_part = y_full.clone()
    rank = lora_b.shape[2]
    for p, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        lora_add(per_part[:, 3 + start:3 + end], x, lora_a[:, p * rank:(p + 1) * rank], lora_b[:, start:end],
                 slot, scale)
    lora_add(y, x, lora_a, lora_b, slot, scale, ends)
    torch.testing.assert_close(y_full, per_part, rtol=1e-6, atol=1e-6)


def test_the_dispatched_op_and_its_fake_agree_with_the_wrapper():
    gen = torch.Generator().manual_seed(1)
    for parts in (None, GATE_UP):
        n = 20 if parts is None else sum(parts)
        y_full, y, x, lora_a, lora_b, slot, scale, _, ends = make_case(9, n, 12, [3, 6], torch.float32, gen, pad=2,
                                                                       parts=parts)
        expected = y_full.clone()
        lora_add_reference(expected[:, 2:2 + n], x, lora_a, lora_b, slot, scale, ends)
        torch.ops.kiln.lora_add(y, x, lora_a, lora_b, slot, scale, ends)  # through the dispatcher, a view mutated
        assert torch.equal(y_full, expected)
        meta = [v.to("meta") for v in (y, x, lora_a, lora_b, slot, scale)]
        assert torch.ops.kiln.lora_add(*meta, ends) is None


def _bad(**changes):
    gen = torch.Generator().manual_seed(2)
    _, y, x, lora_a, lora_b, slot, scale, _, _ = make_case(4, 8, 6, [2, 2], torch.float16, gen)
    args = dict(y=y, x=x, lora_a=lora_a, lora_b=lora_b, slot=slot, scale=scale, part_ends=None)
    args.update({name: change(args) for name, change in changes.items()})
    lora_add(**args)


@pytest.mark.parametrize("changes, message", [
    (dict(x=lambda a: a["x"].float()), r"x has dtype torch.float32; expected one of \['torch.float16'\]"),
    (dict(y=lambda a: a["y"].to(torch.int32)), "y has dtype torch.int32"),
    (dict(slot=lambda a: a["slot"].long()), "slot has dtype torch.int64"),
    (dict(scale=lambda a: a["scale"].half()), "scale has dtype torch.float16"),
    (dict(x=lambda a: a["x"][:3]), r"x.shape\[0\] is 3, expected 4 \(rows of y\)"),
    (dict(lora_a=lambda a: a["lora_a"][..., :5]), r"lora_a.shape\[2\] is 5, expected 6 \(input width K of x\)"),
    (dict(lora_b=lambda a: a["lora_b"][:, :7]), r"lora_b.shape\[1\] is 7, expected 8 \(output width N of y\)"),
    (dict(lora_b=lambda a: a["lora_b"][..., :1]), r"lora_b.shape\[2\] is 1, expected 2 \(rank R: lora_a's rows"),
    (dict(scale=lambda a: a["scale"][:1]), r"scale.shape\[0\] is 1, expected 2 \(slots S of lora_a\)"),
    (dict(lora_a=lambda a: a["lora_a"][0]), r"lora_a must have 3 dims, got shape \(2, 6\)"),
    (dict(x=lambda a: a["x"].T.contiguous().T), "x must be contiguous in its last dim"),
    (dict(slot=lambda a: torch.tensor([0, 2, -1, 1], dtype=torch.int32)), r"slot holds 2: .* in \[0, 2\)"),
    (dict(slot=lambda a: torch.tensor([0, -2, -1, 1], dtype=torch.int32)), "slot holds -2"),
    (dict(scale=lambda a: a["scale"].to("meta")), "tensors are on different devices"),
    (dict(part_ends=lambda a: [3, 7]), r"part_ends \[3, 7\] must be .* the last y's width N=8"),
    (dict(part_ends=lambda a: [5, 5, 8]), r"part_ends \[5, 5, 8\] must be the P >= 1 increasing"),
    (dict(part_ends=lambda a: []), r"part_ends \[\] must be"),
    (dict(part_ends=lambda a: [4, 8]), r"lora_b.shape\[2\] is 2, expected 1 \(rank R: lora_a's rows per part"),
    (dict(part_ends=lambda a: [2, 4, 8]), r"lora_a has 2 rows \(dim 1\), not a multiple of the 3 parts"),
])
def test_bad_arguments_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        _bad(**changes)


# --- Triton's interpreter ---


def interpreted_checks() -> None:
    """The kernel against the reference, float32 and float16, at shapes small enough for the interpreter."""
    from kiln.plugins.triton_lora import launch, launch_settings, lora_add_triton

    gen = torch.Generator().manual_seed(0)
    # (T, N, K, ranks, slots, pad, parts, settings): the default settings at T = 1 and 3; then forced ones: two
    # K chunks per split (k_per_split = 2 * BLOCK_K) over three splits with a ragged last chunk, ragged N
    # blocks (in every part), rank 1 and 5 padded to 8 (BLOCK_R 16 masks the rest). Fused layers: q/k/v and
    # gate/up scaled down, ranks 8 and 16 padded to 16, slots -1 mixed in; four and five parts (two expands).
    forced = dict(BLOCK_PR=16, BLOCK_K=16, k_per_split=32, splits=3, BLOCK_R=16, BLOCK_N=16)
    forced_qkv = dict(forced, BLOCK_PR=64)
    cases = [(1, 40, 300, [8, 4], [1], 0, None, None),
             (3, 37, 70, [16, 8, 2], [2, -1, 0], 3, None, None),
             (4, 45, 90, [1, 5, 8], [0, 2, 1, 2], 2, None, forced),
             (2, 24, 20, [4], [-1, -1], 1, None, None),
             (1, 48, 300, [8, 16], [1], 0, QKV, None),
             (5, 48, 70, [8, 16], [0, -1, 1, 1, -1], 2, QKV, None),
             (4, 45, 90, [16, 8], [1, 0, -1, 1], 1, [29, 8, 8], forced_qkv),  # blocks of 16 ragged in each part
             (3, 48, 40, [16, 4, 8], [2, 0, -1], 0, GATE_UP, None),
             (3, 31, 24, [6, 3], [1, 0, 1], 1, [5, 7, 9, 10], None),
             (2, 40, 24, [8], [0, 0], 0, [8] * 5, forced_qkv)]
    for dtype in (torch.float32, torch.float16):
        for t, n, k, ranks, slots, pad, parts, settings in cases:
            what = f"T={t} N={n} K={k} ranks={ranks} parts={parts} {dtype} settings={settings}"
            y_full, y, x, lora_a, lora_b, slot, scale, _, ends = make_case(t, n, k, ranks, dtype, gen, slots=slots,
                                                                           pad=pad, parts=parts)
            before, want = y_full.clone(), y_full.clone()
            lora_add_reference(want[:, pad:pad + n], x, lora_a, lora_b, slot, scale, ends)
            if settings is None:
                if t == 1:  # one row still spreads over several programs
                    assert launch_settings(t, n, k, max(ranks), 132, len(ends))["splits"] >= 2, what
                lora_add_triton(y, x, lora_a, lora_b, slot, scale, ends)
            else:
                launch(y, x, lora_a, lora_b, slot, scale, ends, settings)
            assert_lora_close(y_full, want, before, slot, pad, what)
    # lora_b a slice of a stacked [S, N + 11, R] (strided slots and rows) and an out-of-range slot skipped.
    _, y, x, lora_a, lora_b, slot, scale, _, ends = make_case(3, 20, 33, [4, 4], torch.float32, gen, slots=[1, 0, 1],
                                                              parts=[12, 8])
    stacked = torch.cat([lora_b, torch.randn(2, 11, 4)], 1)
    want = y.clone()
    lora_add_reference(want, x, lora_a, stacked[:, :20], slot, scale, ends)
    lora_add_triton(y, x, lora_a, stacked[:, :20], slot, scale, ends)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    skipped = y.clone()
    lora_add_triton(y, x, lora_a, lora_b, torch.tensor([5, -3, 2], dtype=torch.int32), scale, ends)
    assert torch.equal(y, skipped)
    lora_add_triton(y[:0], x[:0], lora_a, lora_b, slot[:0], scale, ends)  # T = 0 launches nothing


_RUN = """
import sys
sys.path.insert(0, {tests!r})
import test_lora_op as checks
checks.interpreted_checks()
print("ok")
"""


@needs_triton
def test_interpreted_kernel_matches_the_reference():
    out = run_interpreted(_RUN.format(tests=str(Path(__file__).parent)), timeout=180)
    assert out.strip().endswith("ok")


# --- CUDA ---

needs_cuda_kernels = pytest.mark.skipif(not (torch.cuda.is_available() and USE_TRITON),
                                        reason="needs CUDA and triton (with KILN_DISABLE_TRITON unset)")
HIDDEN, KV, INTER = 4096, 1024, 14336  # Llama-3.1-8B: q/o, k/v, gate/up outputs; down's input is INTER
# (K, part sizes): q/o, k/v, gate/up and down alone, the fused qkv and gate_up, and a TP=8 rank's qkv.
LLAMA_8B = [(HIDDEN, [HIDDEN]), (HIDDEN, [KV]), (HIDDEN, [INTER]), (INTER, [HIDDEN]),
            (HIDDEN, [HIDDEN, KV, KV]), (HIDDEN, [INTER, INTER]), (HIDDEN, [HIDDEN // 8, 128, 128])]


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k, parts", LLAMA_8B)
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("t", [1, 64, 256])
def test_cuda_kernel_matches_the_reference_at_llama_8b_shapes(dtype, k, parts, rank, t):
    n = sum(parts)
    gen = torch.Generator().manual_seed(t + rank + n)
    ranks = [rank, max(1, rank // 2), rank, rank // 4 or 1]  # ragged ranks padded to the largest
    y_full, y, x, lora_a, lora_b, slot, scale, _, ends = make_case(t, n, k, ranks, dtype, gen, "cuda", pad=64,
                                                                   parts=parts)
    before, want = y_full.clone(), y_full.clone()
    lora_add_reference(want[:, 64:64 + n], x, lora_a, lora_b, slot, scale, ends)
    lora_add(y, x, lora_a, lora_b, slot, scale, ends)  # the wrapper: the kernel itself for plain CUDA tensors
    assert_lora_close(y_full, want, before, slot, 64, f"T={t} K={k} parts={parts} R={rank} {dtype}")


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("parts", [[KV], [HIDDEN, KV, KV]])
@pytest.mark.parametrize("t", [1, 64])
def test_cuda_kernel_in_a_cuda_graph_follows_new_slots_scales_and_inputs(t, parts):
    gen = torch.Generator().manual_seed(t)
    dtype, n, k = torch.bfloat16, sum(parts), HIDDEN
    y_full, y, x, lora_a, lora_b, slot, scale, _, ends = make_case(t, n, k, [16, 8, 16], dtype, gen, "cuda", pad=32,
                                                                   parts=parts)
    base = y_full.clone()
    lora_add(y, x, lora_a, lora_b, slot, scale, ends)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_add(y, x, lora_a, lora_b, slot, scale, ends)
    for step in range(3):
        # New values in the captured buffers, as the runner writes them between steps (no host sync).
        y_full.copy_(base)
        x.copy_(torch.randn(t, k, generator=gen).to("cuda", dtype))
        slot.copy_(torch.randint(-1, 3, (t,), generator=gen, dtype=torch.int32))
        scale.copy_(torch.rand(3, generator=gen) + step)
        lora_a[step % 3].mul_(-1)  # an adapter swapped into a slot
        want = base.clone()
        lora_add_reference(want[:, 32:32 + n], x, lora_a, lora_b, slot, scale, ends)
        graph.replay()
        assert_lora_close(y_full, want, base, slot, 32, f"T={t} parts={parts} replay {step}")
