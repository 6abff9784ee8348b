"""The operator references against independent formulations, their torch.library registration, and
the wrappers' argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from kiln.plugins import (
    fused_add_rms_norm,
    paged_attention,
    rms_norm,
    rotary_embedding,
    rotary_embedding_and_write_kv,
    silu_and_mul,
    write_kv_cache,
)


def _dense_attention(q, k, v, sliding_window=0):
    # q: [n, Hq, D] are the last n of L positions; k, v: [L, Hk, D]
    n, heads, _ = q.shape
    length = k.shape[0]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    q_pos = torch.arange(length - n, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    mask = k_pos <= q_pos
    if sliding_window:
        mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask)
    return out.transpose(0, 1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("sliding_window", [0, 5])
def test_paged_attention_matches_dense_attention(block_size, sliding_window):
    torch.manual_seed(0)
    heads, kv_heads, dim = 8, 2, 16
    # (tokens already cached, new tokens): prefill, chunk after a cached prefix, decodes.
    seqs = [(0, 9), (13, 6), (20, 1), (0, 1), (31, 1)]
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks).tolist()  # scattered blocks: the table must be followed
    tables, qs, refs, starts, lens = [], [], [], [0], []
    for cached, new in seqs:
        length = cached + new
        blocks = [free.pop() for _ in range(-(-length // block_size))]
        tables.append(blocks)
        k, v = torch.randn(length, kv_heads, dim), torch.randn(length, kv_heads, dim)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(length)])
        write_kv_cache(k, v, k_cache, v_cache, slots)
        q = torch.randn(new, heads, dim)
        qs.append(q)
        refs.append(_dense_attention(q * 1.0, k, v, sliding_window))
        starts.append(starts[-1] + new)
        lens.append(length)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = paged_attention(torch.cat(qs), k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32),
                          torch.tensor(starts, dtype=torch.int32), dim ** -0.5, sliding_window)
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)


def test_write_kv_cache_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 1, 2)
    write_kv_cache(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(-1, 2)[[0, 5]].eq(1).all() and k_cache.sum() == 4
    assert v_cache.view(-1, 2)[[0, 5]].eq(2).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotary_and_kv_write_equals_the_two_ops(dtype):
    torch.manual_seed(0)
    tokens, heads, kv_heads, dim = 6, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)  # views into one fused output
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1))
    freqs = torch.randn(tokens, dim // 2)
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.tensor([3, -1, 0, 9, -1, 12])
    k_cache = torch.randn(4, 4, kv_heads, dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = rotary_embedding(q, k, cos, sin)
    write_kv_cache(ref_k, v, ref_k_cache, ref_v_cache, slots)
    out_q = rotary_embedding_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(out_q, ref_q) and torch.equal(k_cache, ref_k_cache) and torch.equal(v_cache, ref_v_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_transformers(dtype):
    torch.manual_seed(0)
    hf = LlamaRMSNorm(32, eps=1e-5).to(dtype)
    hf.weight.data.normal_()
    x, residual = torch.randn(7, 32, dtype=dtype), torch.randn(7, 32, dtype=dtype)
    assert torch.equal(rms_norm(x, hf.weight.data, 1e-5), hf(x))
    normed, summed = fused_add_rms_norm(x, residual, hf.weight.data, 1e-5)
    assert torch.equal(summed, x + residual) and torch.equal(normed, hf(x + residual))


def test_rotary_matches_transformers():
    torch.manual_seed(0)
    tokens, dim = 5, 16
    positions = torch.tensor([0, 3, 7, 8, 100])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(positions.float(), inv_freq)
    q, k = torch.randn(tokens, 4, dim), torch.randn(tokens, 2, dim)
    emb = torch.cat((freqs, freqs), dim=-1)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None],
                                        emb.sin()[None])
    out_q, out_k = rotary_embedding(q, k, freqs.cos(), freqs.sin())
    assert torch.equal(out_q, ref_q[0].transpose(0, 1)) and torch.equal(out_k, ref_k[0].transpose(0, 1))


def test_silu_and_mul():
    x = torch.randn(3, 10)
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])


def test_ops_pass_torch_library_opcheck():
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    cos, sin = torch.randn(3, 4), torch.randn(3, 4)
    k_cache = torch.zeros(4, 2, 2, 8)
    cases = [
        (torch.ops.kiln.rms_norm.default, (q, torch.ones(8), 1e-6)),
        (torch.ops.kiln.fused_add_rms_norm.default, (q, q.clone(), torch.ones(8), 1e-6)),
        (torch.ops.kiln.silu_and_mul.default, (torch.randn(3, 8),)),
        (torch.ops.kiln.rotary_embedding.default, (q, k, cos, sin)),
        (torch.ops.kiln.write_kv_cache.default, (k, k.clone(), k_cache, k_cache.clone(), torch.tensor([0, 1, 2]))),
        (torch.ops.kiln.rotary_embedding_and_write_kv.default,
         (q, k, k.clone(), cos, sin, k_cache, k_cache.clone(), torch.tensor([0, -1, 2]))),
        (torch.ops.kiln.paged_attention.default,
         (q, k_cache, k_cache.clone(), torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
          torch.tensor([0, 3], dtype=torch.int32), 0.3, 0)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def _fused_rotary_kv_call(**bad):
    args = dict(q=torch.randn(2, 4, 8), k=torch.randn(2, 2, 8), v=torch.randn(2, 2, 8), cos=torch.randn(2, 4),
                sin=torch.randn(2, 4), k_cache=torch.zeros(4, 2, 2, 8), v_cache=torch.zeros(4, 2, 2, 8),
                slot_mapping=torch.tensor([0, 1]))
    args.update(bad)
    if "k_cache" in bad:
        args["v_cache"] = torch.zeros_like(bad["k_cache"])
    return rotary_embedding_and_write_kv(**args)


@pytest.mark.parametrize("call, message", [
    (lambda: rms_norm(torch.randn(2, 8), torch.ones(4), 1e-6), r"weight.shape\[0\] is 4, expected 8"),
    (lambda: rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.float16), 1e-6), "weight has dtype"),
    (lambda: silu_and_mul(torch.randn(2, 7)), "must be even"),
    (lambda: rotary_embedding(torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 5), torch.randn(2, 5)),
     r"cos has 5 angles per token; it needs 1 to half the head dim \(4\)"),
    # fewer angles than half the head is partial rotary; sin must have cos's
    (lambda: rotary_embedding(torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 3), torch.randn(2, 4)),
     r"sin.shape\[1\] is 4, expected 3"),
    (lambda: write_kv_cache(torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.zeros(4, 2, 2, 8),
                            torch.zeros(4, 2, 2, 8), torch.tensor([0, 1], dtype=torch.int32)), "slot_mapping has dtype"),
    (lambda: _fused_rotary_kv_call(cos=torch.randn(2, 5)), r"cos has 5 angles per token"),
    (lambda: _fused_rotary_kv_call(k=torch.randn(2, 2, 8, dtype=torch.float16)), "k has dtype"),
    (lambda: _fused_rotary_kv_call(v=torch.randn(2, 1, 8)), "v shape"),
    (lambda: _fused_rotary_kv_call(k_cache=torch.zeros(4, 2, 3, 8)), r"k_cache.shape\[2\] is 3, expected 2"),
    (lambda: _fused_rotary_kv_call(slot_mapping=torch.tensor([0, 1], dtype=torch.int32)), "slot_mapping has dtype"),
    (lambda: paged_attention(torch.randn(2, 3, 8), torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8),
                             torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                             torch.tensor([0, 2], dtype=torch.int32), 1.0), "not a multiple of kv heads"),
])
def test_wrappers_reject_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_paged_attention_refuses_strided_seq_lens():
    q = torch.zeros(2, 4, 8)
    cache = torch.zeros(3, 4, 2, 8)
    lens = torch.tensor([[1, 9], [1, 9]], dtype=torch.int32)[:, 0]  # strided view
    with pytest.raises(ValueError, match="seq_lens must be contiguous"):
        paged_attention(q, cache, cache, torch.zeros(2, 1, dtype=torch.int32), lens,
                        torch.tensor([0, 1, 2], dtype=torch.int32), 1.0)
