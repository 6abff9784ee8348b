"""The paged-attention reference (the CPU path) on what the runtime and the GPU tests hand it: decode rows
batched among prefill chunks, padding rows (seq_len 0), stale or NaN slots that no sequence owns, table
entries past a sequence's blocks, bfloat16 caches. Checked against dense attention per sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.plugins import paged_attention


def _dense(q, k, v, sliding_window):
    # q: [n, Hq, D], the last n of L positions; k, v: [L, Hk, D] -> [n, Hq, D], in float32
    n, heads, _ = q.shape
    length = k.shape[0]
    k = k.float().repeat_interleave(heads // k.shape[1], dim=1)
    v = v.float().repeat_interleave(heads // v.shape[1], dim=1)
    q_pos = torch.arange(length - n, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    mask = k_pos <= q_pos
    if sliding_window:
        mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask)
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [0, 7])
@pytest.mark.parametrize("seqs", [
    [(30, 1), (0, 9), (4, 1), (13, 6), (0, 1), (-1, 1), (40, 1)],  # decodes among chunks, one padding row
    [(30, 1), (4, 1), (0, 1), (-1, 1), (55, 1)],  # decode only (T == S), one padding row
    [(12, 5), (0, 3)],  # chunks only
    [(21, 1), (21, 1)],  # decodes of one length: no padding to mask
    [(9, 1)],  # batch 1
], ids=["mixed", "decode", "chunks", "same-length", "one"])
def test_paged_attention_reference_matches_dense(seqs, sliding_window, dtype):
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size = 6, 2, 16, 4
    lengths = [cached + new for cached, new in seqs]  # a padding row has seq_len 0
    num_blocks = sum(-(-n // block_size) for n in lengths) + 4
    # Slots no sequence owns hold NaN: reading one (or a table entry past a sequence's blocks) shows.
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    width = max(map(len, tables)) + 1
    qs, refs = [], []
    for (_, new), table, length in zip(seqs, tables, lengths):
        k = torch.randn(length, kv_heads, dim).to(dtype)
        v = torch.randn(length, kv_heads, dim).to(dtype)
        for p in range(length):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        q = torch.randn(new, heads, dim).to(dtype)
        qs.append(q)
        refs.append(_dense(q, k, v, sliding_window) if length else torch.zeros(new, heads, dim))
        table += [free[0]] * (width - len(table))  # garbage past the sequence's blocks
    starts = torch.tensor([0] + [new for _, new in seqs]).cumsum(0).to(torch.int32)
    out = paged_attention(torch.cat(qs), k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
                          torch.tensor(lengths, dtype=torch.int32), starts, dim ** -0.5, sliding_window)
    assert out.dtype == dtype and out.shape == (int(starts[-1]), heads, dim) and out.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), torch.cat(refs).float(), atol=tol, rtol=tol)


def test_decode_rows_do_not_depend_on_the_batch():
    """A sequence's decode output is the same alone and batched with longer sequences (up to rounding of
    the padded reduction)."""
    torch.manual_seed(1)
    k_cache = torch.randn(64, 16, 2, 32)
    v_cache = torch.randn(64, 16, 2, 32)
    q = torch.randn(3, 4, 32)
    tables = torch.tensor([[3, 9, 0, 0], [1, 2, 4, 5], [7, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 61, 5], dtype=torch.int32)
    starts = torch.arange(4, dtype=torch.int32)
    batched = paged_attention(q, k_cache, v_cache, tables, lens, starts, 0.2)
    for s in range(3):
        alone = paged_attention(q[s:s + 1], k_cache, v_cache, tables[s:s + 1], lens[s:s + 1], starts[:2], 0.2)
        torch.testing.assert_close(batched[s:s + 1], alone, atol=1e-6, rtol=1e-6)
