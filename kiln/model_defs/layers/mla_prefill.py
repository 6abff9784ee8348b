"""MLA's explicit form for a step's long sequences (prefill): keys and values up-projected from the latent cache.

For the sequences `MLASplit.explicit` names (mla_split.py), every key's cached latent (prefix-cached tokens
and earlier chunks included; the step's own latents are already written) is read once, up-projected for this
rank's heads in one GEMM with kv_b_proj's weight,

    k_h = [W_UK_h c ; k_pe]   (head dim dn + dr)      v_h = W_UV_h c   (head dim dv)

and each sequence runs ordinary causal attention, query i of n seeing the keys <= L - n + i. On CUDA that is
`scaled_dot_product_attention`'s flash kernel in the model dtype (v padded to the qk head dim, which flash
needs, and the output sliced back); on the CPU the math kernel in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..mla_config import MLAConfig
from .mla_split import MLASplit


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Hl, n, D], k [Hl, L, D], v [Hl, L, Dv] -> [Hl, n, Dv]: query i sees keys <= L - n + i."""
    n, length, dv = q.shape[1], k.shape[1], v.shape[-1]
    if q.is_cuda and dv < q.shape[-1]:  # flash wants one head dim for q, k and v
        v = F.pad(v, (0, q.shape[-1] - dv))
    q, k, v = q[None], k[None], v[None]  # [1, Hl, ., D]: a batch of one
    if n == length:  # upper-left causal is lower-right here, and the flash kernel's own
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:  # lower-right causal (the queries are the last n positions): flash on CUDA, a mask elsewhere
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, length), scale=scale)
    return out[0, ..., :dv]


def explicit_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, kv_b_weight: torch.Tensor,
                     mla: MLAConfig, scale: float, split: MLASplit, out: torch.Tensor) -> None:
    """Writes the explicit sequences' attention outputs into their rows of `out`.
    q_nope [T, Hl, dn], q_pe [T, Hl, dr] (rotated): the step's queries; cache [N, block_size, 1, r + dr];
    kv_b_weight [Hl (dn + dv), r]: this rank's kv_b_proj weight; out [T, Hl, dv] (before o_proj)."""
    heads, dn, dv = q_nope.shape[1], mla.qk_nope_head_dim, mla.v_head_dim
    latent = cache.view(-1, mla.latent_dim).index_select(0, split.key_slots)  # [K, r + dr], K = sum of L
    c, k_pe = latent.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    kv = F.linear(c, kv_b_weight).view(-1, heads, dn + dv)  # [K, Hl, dn + dv]: every key of every head at once
    compute = q_nope.dtype if q_nope.is_cuda else torch.float32
    for seq in split.explicit:
        k_nope, v = kv[seq.keys].split([dn, dv], dim=-1)  # [L, Hl, dn], [L, Hl, dv]
        rope = k_pe[seq.keys, None, :].expand(-1, heads, -1)  # [L, Hl, dr]: one rope key shared by the heads
        k = torch.cat([k_nope, rope], dim=-1).to(compute).transpose(0, 1)  # [Hl, L, dn + dr]
        q = torch.cat([q_nope[seq.rows], q_pe[seq.rows]], dim=-1).to(compute).transpose(0, 1)  # [Hl, n, dn + dr]
        o = _causal_attention(q, k, v.to(compute).transpose(0, 1), scale)  # [Hl, n, dv]
        out[seq.rows] = o.transpose(0, 1)
