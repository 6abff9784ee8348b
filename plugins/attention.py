"""Paged attention over a packed batch that mixes prefill chunks and decode tokens.

Sequence s owns the query tokens q[query_start_loc[s]:query_start_loc[s+1]]; they are its last
n_s = query_start_loc[s+1] - query_start_loc[s] tokens, so query i sits at position
seq_lens[s] - n_s + i and attends causally to the seq_lens[s] keys of the sequence (its cached prefix
and this step's tokens, already written to the cache), through block_tables[s]. A decode token is
simply a chunk of length 1. GQA: query head h reads kv head h // (Hq // Hk).

On CUDA (when `USE_TRITON`) the op runs the Triton kernels of triton_attention.py: a unified kernel
for mixed batches, and a split-K decode path when T == S. Both take their launch shapes from tensor
shapes only, never from tensor values, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch

from ._checks import (
    FLOAT_DTYPES,
    check_dims,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    check_size,
)
from ._triton import USE_TRITON


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    # q: [T, Hq, D]; k_cache, v_cache: [N, block_size, Hk, D]; block_tables: [S, max_blocks] int32;
    # seq_lens: [S] int32; query_start_loc: [S+1] int32 -> out: [T, Hq, D], contiguous
    out = q.new_empty(q.shape)
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_s = q[starts[s]:starts[s + 1]].float()  # [n, Hq, D]
        n = q_s.shape[0]
        if n == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[s, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()  # [L, Hk, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_s, k) * scale  # [Hq, n, L]
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window > 0:
            allowed &= k_pos > q_pos - sliding_window
        scores.masked_fill_(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[s]:starts[s + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


_paged_attention_op = torch.library.custom_op("kiln::paged_attention", mutates_args=())(paged_attention_reference)


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window):
    return q.new_empty(q.shape)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Causal attention of the packed queries q: [T, Hq, D] over the paged cache; returns [T, Hq, D].

    sliding_window > 0 limits each query to the last `sliding_window` keys (itself included).
    q may be a strided view (e.g. a slice of the fused qkv output) but its last dim must be contiguous;
    k_cache, v_cache must be contiguous. A sequence with seq_lens[s] == 0 (a padding row of a captured
    graph) gives zeros. Precondition: every sequence has at least one query token, so that T == S means
    one token each: such batches take the GPU's split-K decode path, which relies on it.
    """
    for name, t, nd in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4),
                        ("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1),
                        ("query_start_loc", query_start_loc, 1)):
        check_dims(name, t, nd)
    check_dtype("q", q, FLOAT_DTYPES)
    check_dtype("k_cache", k_cache, FLOAT_DTYPES)
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        check_dtype(name, t, (torch.int32,))
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} differs from k_cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    check_last_dim_contiguous("q", q)
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    check_last_dim_contiguous("block_tables", block_tables)
    check_size("k_cache", k_cache, 3, q.shape[2], "head dim of q")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of kv heads {k_cache.shape[2]}")
    check_size("block_tables", block_tables, 0, seq_lens.shape[0], "sequences in seq_lens")
    check_size("query_start_loc", query_start_loc, 0, seq_lens.shape[0] + 1, "sequences + 1")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
                      query_start_loc=query_start_loc)
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0 = off), got {sliding_window}")
    return _paged_attention_op(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, float(scale),
                               int(sliding_window))


if USE_TRITON:
    from .triton_attention import paged_attention_triton

    _paged_attention_op.register_kernel("cuda")(paged_attention_triton)
