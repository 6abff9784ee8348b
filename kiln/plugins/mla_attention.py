"""Multi-head latent attention (DeepSeek's MLA) over a paged cache of compressed latents, absorbed form.

Per token the cache holds one row of R + P values: the compressed kv c [R] and the rotated shared rope key
k_pe [P] (cache [N, block_size, 1, R + P], keys and values at once). Each head's query comes already taken into
latent space (q_lat = W_UK^T q_nope, [R]) with its rotated rope part q_pe [P]; the op computes

    out[t, h] = sum_j softmax_j(scale * (q_lat[t, h] . c_j + q_pe[t, h] . k_pe_j)) c_j      -> [T, H, R]

over the causal keys j of the token's sequence (paged as `paged_attention`: sequence s's queries are its last
tokens). The caller applies W_UV. The reference is `paged_attention`'s over [q_lat ; q_pe] with the cache as
both keys and values (multi-query attention of head dim R + P), keeping the output's first R values; on CUDA
the Triton kernel of triton_mla_attention.py reads each cached row once for both, splits the dots into the
latent and rope parts (no padding of R + P to a power of two) and, for decode steps, the keys over programs.
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
from ._eager import runs_reference_directly
from ._spec import OpSpec, define
from .attention import paged_attention, paged_attention_reference
from .step_plan import StepPlan


def mla_attention_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    q = torch.cat([q_lat, q_pe], dim=-1)  # [T, H, R + P]
    out = paged_attention_reference(q, cache, cache, block_tables, seq_lens, query_start_loc, scale, 0)
    return out[..., :q_lat.shape[-1]].contiguous()


def _mla_attention_fake(q_lat, q_pe, cache, block_tables, seq_lens, query_start_loc, scale):
    return q_lat.new_empty(q_lat.shape)


MLA_ATTENTION = OpSpec("kiln::mla_attention", """
    Tensor q_lat              [T, H, R] float32 / float16 / bfloat16, last dim contiguous: queries in latent space
    Tensor q_pe               [T, H, P] q_lat's dtype, last dim contiguous: the rotated rope part of the queries
    Tensor cache              [N, block_size, 1, R + P] q_lat's dtype, contiguous: per token c, then rotated k_pe
    Tensor block_tables       [S, max_blocks] int32, each sequence's cache blocks
    Tensor seq_lens           [S] int32, each sequence's keys (cached prefix + this step's tokens)
    Tensor query_start_loc    [S + 1] int32, sequence s's queries are rows loc[s]:loc[s + 1]
    float scale               multiplies q_lat . c + q_pe . k_pe
    -> Tensor                 [T, H, R] q_lat's dtype, contiguous: the softmax-weighted sum of the keys' c
    """, reference=mla_attention_reference, fake=_mla_attention_fake,
    kernel="triton_mla_attention.mla_attention_triton")
_mla_attention = define(MLA_ATTENTION)


def mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                  plan: StepPlan | None = None) -> torch.Tensor:
    """Absorbed MLA attention (see the module docstring): q_lat [T, H, R], q_pe [T, H, P] over the latent cache
    [N, block_size, 1, R + P] -> [T, H, R]. Same paging and preconditions as `paged_attention` (every sequence
    has at least one query token; a sequence of seq_len 0 gives zeros). `plan`: the step's `StepPlan` where the
    reference runs."""
    check_dims("q_lat", q_lat, 3)
    check_dims("q_pe", q_pe, 3)
    check_dims("cache", cache, 4)
    check_dtype("q_lat", q_lat, FLOAT_DTYPES)
    check_dtype("q_pe", q_pe, (q_lat.dtype,))
    check_dtype("cache", cache, (q_lat.dtype,))
    check_size("q_pe", q_pe, 0, q_lat.shape[0], "tokens of q_lat")
    check_size("q_pe", q_pe, 1, q_lat.shape[1], "heads of q_lat")
    check_size("cache", cache, 2, 1, "one latent head")
    check_size("cache", cache, 3, q_lat.shape[2] + q_pe.shape[2], "R + P (q_lat's and q_pe's last dims)")
    check_last_dim_contiguous("q_lat", q_lat)
    check_last_dim_contiguous("q_pe", q_pe)
    if not cache.is_contiguous():
        raise ValueError("cache must be contiguous")
    check_same_device(q_lat=q_lat, q_pe=q_pe, cache=cache, block_tables=block_tables, seq_lens=seq_lens,
                      query_start_loc=query_start_loc)
    if runs_reference_directly(q_lat):  # the paged-attention reference, with the step's plan
        q = torch.cat([q_lat, q_pe], dim=-1)
        out = paged_attention(q, cache, cache, block_tables, seq_lens, query_start_loc, scale, plan=plan)
        return out[..., :q_lat.shape[-1]].contiguous()
    return _mla_attention.for_tensor(q_lat)(q_lat, q_pe, cache, block_tables, seq_lens, query_start_loc,
                                           float(scale))
