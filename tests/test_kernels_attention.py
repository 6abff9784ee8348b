"""The Triton paged-attention kernels against the PyTorch reference, on CUDA.

Cache slots that no sequence owns hold NaN: a kernel that reads a key at a position >= seq_lens[s]
(or through a block-table entry past a sequence's blocks) turns its output NaN.
"""

from __future__ import annotations

import pytest
import torch

from kiln.plugins.attention import paged_attention_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
# (tokens already cached, new tokens): fresh prefills, chunks after a cached prefix, decodes.
MIXED = [(0, 37), (50, 20), (300, 1), (0, 1), (1500, 300), (17, 1), (129, 130), (64, 64)]


def _make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, *, padding_rows=0, garbage_tail=False,
                strided_q=False, seed=0):
    """Packed inputs on CUDA for `seqs`, plus `padding_rows` sequences of seq_len 0 with one token each."""
    torch.manual_seed(seed)
    seqs = list(seqs) + [(-1, 1)] * padding_rows  # cached -1 + 1 new = seq_len 0
    lengths = [cached + new for cached, new in seqs]
    num_blocks = sum(-(-length // block_size) for length in lengths) + 4
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    v_cache = k_cache.clone()
    free = torch.randperm(num_blocks).tolist()  # scattered blocks: the table must be followed
    tables = [[free.pop() for _ in range(-(-length // block_size))] for length in lengths]
    width = max(map(len, tables)) + 2
    for table, length in zip(tables, lengths):
        positions = torch.arange(length)
        slots = (torch.tensor(table, dtype=torch.long)[positions // block_size] * block_size
                 + positions % block_size).cuda()
        for cache in (k_cache, v_cache):
            cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(length, kv_heads, head_dim, device="cuda",
                                                                   dtype=dtype)
        # Entries past a sequence's blocks: 0 or another sequence's block, never to be read.
        table += [free[0] if garbage_tail and free else 0] * (width - len(table))
    starts = torch.tensor([0] + [new for _, new in seqs]).cumsum(0)
    num_tokens = int(starts[-1])
    if strided_q:  # q as the fused qkv projection gives it: a slice of a wider row
        wide = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim + 8, device="cuda", dtype=dtype)
        q = wide[:, 8:8 + heads * head_dim].view(num_tokens, heads, head_dim)
    else:
        q = torch.randn(num_tokens, heads, head_dim, device="cuda", dtype=dtype)
    as_int = dict(dtype=torch.int32, device="cuda")
    return (q, k_cache, v_cache, torch.tensor(tables, **as_int), torch.tensor(lengths, **as_int),
            starts.to(**as_int))


def _check(args, sliding_window, padding_rows=0):
    from kiln.plugins.triton_attention import paged_attention_triton

    q = args[0]
    scale = q.shape[2] ** -0.5
    out = paged_attention_triton(*args, scale, sliding_window)
    ref = paged_attention_reference(*args, scale, sliding_window)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert torch.isfinite(out).all()
    if padding_rows:
        assert out[-padding_rows:].eq(0).all()
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("dtype, heads, kv_heads, head_dim, block_size, sliding_window", [
    (torch.bfloat16, 32, 8, 128, 16, 0),
    (torch.float16, 32, 8, 128, 16, 0),
    (torch.bfloat16, 8, 8, 64, 32, 0),
    (torch.bfloat16, 16, 2, 256, 64, 0),
    (torch.float16, 8, 2, 80, 128, 0),
    (torch.bfloat16, 32, 8, 128, 4, 0),
    (torch.bfloat16, 32, 8, 128, 16, 96),
    (torch.float16, 16, 2, 256, 32, 50),
])
def test_mixed_batch_matches_reference(dtype, heads, kv_heads, head_dim, block_size, sliding_window):
    args = _make_batch(MIXED, heads, kv_heads, head_dim, block_size, dtype, padding_rows=1, garbage_tail=True)
    _check(args, sliding_window, padding_rows=1)


def _decode_seqs(batch, max_len, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lengths[0] = max_len
    return [(length - 1, 1) for length in lengths]


@pytest.mark.parametrize("dtype, heads, kv_heads, head_dim, block_size, batch, max_len, sliding_window", [
    (torch.bfloat16, 32, 8, 128, 16, 1, 4000, 0),
    (torch.float16, 32, 8, 128, 32, 1, 4000, 0),
    (torch.bfloat16, 32, 8, 128, 16, 1, 100, 0),
    (torch.bfloat16, 32, 8, 128, 16, 64, 4000, 0),
    (torch.float16, 32, 8, 128, 64, 64, 200, 0),
    (torch.bfloat16, 16, 2, 256, 128, 4, 3000, 0),
    (torch.bfloat16, 8, 8, 64, 4, 2, 1000, 0),
    (torch.float16, 8, 2, 80, 16, 3, 2500, 0),
    (torch.bfloat16, 32, 8, 128, 16, 4, 4000, 1000),
    (torch.bfloat16, 32, 8, 128, 16, 64, 2000, 300),
])
def test_decode_matches_reference(dtype, heads, kv_heads, head_dim, block_size, batch, max_len, sliding_window):
    args = _make_batch(_decode_seqs(batch, max_len, seed=batch), heads, kv_heads, head_dim, block_size, dtype,
                       padding_rows=2, garbage_tail=True)
    _check(args, sliding_window, padding_rows=2)


def test_decode_splits_long_context_at_small_batch():
    from kiln.plugins.triton_attention import _launch_config

    long_small = _launch_config(1, 1, 8, 4, 128, 2, 4096, 132, decode=True)
    assert long_small.num_splits > 1  # what test_decode_matches_reference's batch-1 long cases exercise
    assert _launch_config(256, 256, 8, 4, 128, 2, 4096, 132, decode=True).num_splits == 1
    assert _launch_config(1, 1, 8, 4, 128, 2, 128, 132, decode=True).num_splits == 1


@pytest.mark.parametrize("seqs", [MIXED, _decode_seqs(5, 3000, seed=1)], ids=["mixed", "decode"])
def test_strided_q(seqs):
    args = _make_batch(seqs, 32, 8, 128, 16, torch.bfloat16, strided_q=True)
    assert not args[0].is_contiguous()
    _check(args, 0)


def test_op_dispatches_to_the_kernel_on_cuda():
    from kiln.plugins.triton_attention import paged_attention_triton

    for seqs in (MIXED, _decode_seqs(3, 2000, seed=2)):
        args = _make_batch(seqs, 16, 4, 64, 16, torch.bfloat16)
        assert torch.equal(torch.ops.kiln.paged_attention(*args, 0.125, 0), paged_attention_triton(*args, 0.125, 0))
