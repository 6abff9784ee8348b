"""Attention sinks (GPT-OSS) in `kiln::paged_attention`: the reference against transformers' formula (the sink
as one more score column, softmaxed and dropped), prefill chunks and decode rows, with sliding windows and GQA;
the Triton kernels against the reference on the CPU (Triton's interpreter) and on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from triton_interpret import needs_triton, run_interpreted

from kiln.plugins.attention import paged_attention, paged_attention_reference

# (tokens already cached, new tokens): a fresh prefill, a chunk after a cached prefix, decodes
SEQS = [(0, 9), (5, 4), (12, 1), (0, 1), (3, 1)]


def _batch(seqs, heads, kv_heads, head_dim, block_size, seed=0):
    """Packed float32 CPU inputs with scattered cache blocks, plus each sequence's dense k, v [L, Hk, D]."""
    g = torch.Generator().manual_seed(seed)
    lengths = [c + n for c, n in seqs]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, dense = [], []
    for length in lengths:
        table = [free.pop() for _ in range(-(-length // block_size))]
        k = torch.randn(length, kv_heads, head_dim, generator=g)
        v = torch.randn(length, kv_heads, head_dim, generator=g)
        pos = torch.arange(length)
        slots = torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, kv_heads, head_dim)[slots] = k
        v_cache.view(-1, kv_heads, head_dim)[slots] = v
        tables.append(table)
        dense.append((k, v))
    width = max(map(len, tables))
    tables = [t + [0] * (width - len(t)) for t in tables]
    starts = torch.tensor([0] + [n for _, n in seqs]).cumsum(0)
    q = torch.randn(int(starts[-1]), heads, head_dim, generator=g)
    i32 = dict(dtype=torch.int32)
    return (q, k_cache, v_cache, torch.tensor(tables, **i32), torch.tensor(lengths, **i32), starts.to(**i32)), dense


def _hf_formula(q, dense, seqs, scale, window, sinks):
    """transformers' eager GPT-OSS attention, sequence by sequence: scores + mask, the sink concatenated as a
    last column, softmax, that column dropped."""
    outs, start = [], 0
    heads = q.shape[1]
    for (cached, new), (k, v) in zip(seqs, dense):
        group = heads // k.shape[1]
        kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qq = q[start:start + new].transpose(0, 1)  # [Hq, n, D]
        scores = qq @ kk.transpose(1, 2) * scale  # [Hq, n, L]
        qpos = torch.arange(cached, cached + new)[:, None]
        kpos = torch.arange(cached + new)[None, :]
        visible = kpos <= qpos
        if window:
            visible &= kpos > qpos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        combined = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, new, 1)], dim=-1)
        probs = combined.softmax(-1)[..., :-1]
        outs.append((probs @ vv).transpose(0, 1))
        start += new
    return torch.cat(outs)


@pytest.mark.parametrize("heads, kv_heads, window", [(4, 2, 0), (4, 2, 3), (2, 2, 0), (8, 2, 5)])
def test_reference_matches_transformers_formula(heads, kv_heads, window):
    args, dense = _batch(SEQS, heads, kv_heads, 16, 4)
    sinks = torch.linspace(-2.0, 6.0, heads)  # large sinks: they take most of the weight
    scale = 16 ** -0.5
    expected = _hf_formula(args[0], dense, SEQS, scale, window, sinks)
    out = paged_attention(*args, scale, window, sinks=sinks)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # decode-only batches take their own path
    decode = [s for s in SEQS if s[1] == 1]
    args_d, dense_d = _batch(decode, heads, kv_heads, 16, 4, seed=1)
    torch.testing.assert_close(paged_attention(*args_d, scale, window, sinks=sinks),
                               _hf_formula(args_d[0], dense_d, decode, scale, window, sinks), atol=1e-5, rtol=1e-5)
    # the sinks change the answer (the check above is not vacuous)
    assert not torch.allclose(out, paged_attention(*args, scale, window), atol=1e-3)


def test_sinks_are_checked():
    args, _ = _batch(SEQS, 4, 2, 16, 4)
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(*args, 0.25, 0, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(*args, 0.25, 0, sinks=torch.zeros(4, dtype=torch.float64))


def test_padding_row_gives_zeros_with_sinks():
    args, _ = _batch([(3, 1), (0, 1)], 2, 1, 8, 4)
    seq_lens = args[4].clone()
    seq_lens[1] = 0  # a captured graph's padding row
    out = paged_attention_reference(*args[:4], seq_lens, args[5], 0.3, 0, None, None, 0.0, torch.ones(2))
    assert out[1].eq(0).all() and torch.isfinite(out).all()


@needs_triton
def test_triton_kernels_match_reference_interpreted():
    run_interpreted(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from test_attention_sinks import SEQS, _batch
        from kiln.plugins.attention import paged_attention_reference
        from kiln.plugins.triton_attention import paged_attention_triton
        for heads, kv_heads, window in ((4, 2, 0), (4, 2, 3)):
            sinks = torch.linspace(-2.0, 6.0, heads)
            # mixed (unified kernel), decode, and decode over 600 keys (split-K: the sink must count once)
            for seqs in (SEQS, [s for s in SEQS if s[1] == 1], [(600, 1), (40, 1)]):
                args, _ = _batch(seqs, heads, kv_heads, 16, 4)
                ref = paged_attention_reference(*args, 0.25, window, None, None, 0.0, sinks)
                out = paged_attention_triton(*args, 0.25, window, None, None, 0.0, sinks)
                torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
        print("ok")
    """)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 96])
def test_triton_kernels_match_reference_cuda(dtype, window):
    from kiln.plugins.triton_attention import paged_attention_triton

    heads, kv_heads, dim = 64, 8, 64  # GPT-OSS's attention shapes
    sinks = torch.linspace(-1.0, 8.0, heads, device="cuda")
    # mixed (unified kernel), then decode with long contexts (split-K: the sink must count once)
    for seqs in ([(0, 37), (50, 20), (300, 1), (1500, 300)], [(2000, 1), (700, 1), (5, 1)]):
        args, _ = _batch(seqs, heads, kv_heads, dim, 16)
        args = tuple(a.cuda() for a in args)
        args = (args[0].to(dtype), args[1].to(dtype), args[2].to(dtype), *args[3:])
        ref = paged_attention_reference(*args, dim ** -0.5, window, None, None, 0.0, sinks)
        out = paged_attention_triton(*args, dim ** -0.5, window, None, None, 0.0, sinks)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
