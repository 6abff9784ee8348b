"""The Triton MLA attention kernel (kiln::mla_attention on CUDA) against its reference: on the CPU through
Triton's interpreter (tiny shapes, float32 and float16: the interpreter mishandles bfloat16), and on CUDA
(DeepSeek-V2-Lite's and V3's shapes, bfloat16, decode with split keys and mixed prefill batches, CUDA graphs).

Cache slots that no sequence owns hold NaN: a kernel that reads a key past seq_lens[s] turns its output NaN.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from triton_interpret import needs_triton, run_interpreted

from kiln.plugins.mla_attention import mla_attention_reference

# (tokens already cached, new tokens) per sequence
DECODES = [(300, 1), (17, 1), (1200, 1), (0, 1), (5, 1)]
MIXED = [(0, 37), (50, 20), (300, 1), (0, 1), (129, 130), (17, 1)]


def mla_batch(seqs, heads: int, rank: int, rope: int, block_size: int, dtype: torch.dtype, device: str,
              seed: int = 0, padding_rows: int = 0):
    """(q_lat, q_pe, cache, block_tables, seq_lens, query_start_loc) for `seqs`, blocks scattered, unowned slots
    NaN; `padding_rows` more sequences of seq_len 0 with one token each (a captured graph's padding)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = list(seqs) + [(-1, 1)] * padding_rows
    lengths = [c + n for c, n in seqs]
    blocks = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks) + 3
    cache = torch.full((num_blocks, block_size, 1, rank + rope), float("nan"), dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(blocks) + 2, dtype=torch.int32)
    for s, (n, length) in enumerate(zip(blocks, lengths)):
        table = [free.pop() for _ in range(n)]
        tables[s, :n] = torch.tensor(table, dtype=torch.int32)
        positions = torch.arange(length)
        slots = torch.tensor(table, dtype=torch.long)[positions // block_size] * block_size + positions % block_size
        cache.view(-1, rank + rope)[slots] = torch.randn(length, rank + rope, generator=gen).to(dtype)
    tokens = sum(n for _, n in seqs)
    q_lat = torch.randn(tokens, heads, rank, generator=gen).to(dtype)
    q_pe = torch.randn(tokens, heads, rope, generator=gen).to(dtype)
    seq_lens = torch.tensor([max(n, 0) for n in lengths], dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor([n for _, n in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    return tuple(t.to(device) for t in (q_lat, q_pe, cache, tables, seq_lens, starts))


def check_mla(seqs, heads, rank, rope, block_size, dtype, device, tolerance, padding_rows=0) -> None:
    from kiln.plugins.triton_mla_attention import mla_attention_triton

    args = mla_batch(seqs, heads, rank, rope, block_size, dtype, device, padding_rows=padding_rows)
    scale = (128 + rope) ** -0.5
    out = mla_attention_triton(*args, scale)
    ref = mla_attention_reference(*(t.cpu().float() if t.is_floating_point() else t.cpu() for t in args), scale)
    assert not out.isnan().any(), f"{seqs} H={heads} R={rank} P={rope} {dtype}: NaN (read an unowned slot?)"
    err = (out.cpu().float() - ref).abs().max().item()
    assert err < tolerance, f"{seqs} H={heads} R={rank} P={rope} {dtype}: max error {err}"


# --- CPU: the kernel under Triton's interpreter ---


def interpreted_mla_checks() -> None:
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
        check_mla([(0, 5), (7, 3), (20, 1)], 4, 16, 8, 4, dtype, "cpu", tolerance)  # mixed, 4 of 16 head rows
        check_mla([(9, 1), (40, 1), (0, 1)], 4, 16, 8, 4, dtype, "cpu", tolerance, padding_rows=2)  # decode
    check_mla([(9, 1), (600, 1)], 20, 32, 16, 4, torch.float32, "cpu", 1e-4)  # 2 head blocks, split keys
    check_mla([(0, 17), (33, 9)], 3, 16, 16, 16, torch.float32, "cpu", 1e-4)
    check_mla([(0, 17), (33, 9), (4, 1)], 8, 16, 16, 16, torch.float16, "cpu", 1e-2)  # 2 tokens x 16 heads a tile
    check_mla([(0, 17), (33, 9), (4, 1)], 20, 16, 16, 16, torch.float16, "cpu", 1e-2)  # 2 blocks of 32 heads


_RUN = """
import sys
sys.path.insert(0, {tests!r})
import test_kernels_mla as checks
checks.interpreted_mla_checks()
print("ok")
"""


@needs_triton
def test_interpreted_mla_kernel_matches_the_reference():
    out = run_interpreted(_RUN.format(tests=str(Path(__file__).parent)))
    assert out.strip().endswith("ok")


# --- CUDA ---

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seqs", [DECODES, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("heads", [16, 128, 8])  # V2-Lite, V3 (one rank), V3 over 16 ranks
@pytest.mark.parametrize("block_size", [16, 64])
def test_mla_kernel_matches_the_reference_at_deepseek_shapes(seqs, heads, block_size):
    check_mla(seqs, heads, 512, 64, block_size, torch.bfloat16, "cuda", 3e-2, padding_rows=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mla_kernel_runs_in_a_cuda_graph():
    from cuda_graph_capture import capture

    from kiln.plugins import mla_attention

    args = mla_batch(DECODES, 16, 512, 64, 16, torch.bfloat16, "cuda")
    eager = mla_attention(*args, 0.1)
    graph, out = capture(lambda: mla_attention(*args, 0.1))
    graph.replay()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
