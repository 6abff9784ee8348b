"""Paged attention over a packed batch that mixes prefill chunks and decode tokens.

Sequence s owns the query tokens q[query_start_loc[s]:query_start_loc[s+1]]; they are its last
n_s = query_start_loc[s+1] - query_start_loc[s] tokens, so query i sits at position
seq_lens[s] - n_s + i and attends causally to the seq_lens[s] keys of the sequence (its cached prefix
and this step's tokens, already written to the cache), through block_tables[s]. A decode token is
simply a chunk of length 1. GQA: query head h reads kv head h // (Hq // Hk). softcap > 0 caps each score
as softcap * tanh(score / softcap) before the mask and the softmax (Gemma 2's attn_logit_softcapping).

On CUDA (when `USE_TRITON`) the op runs the Triton kernels of triton_attention.py: a unified kernel
for mixed batches, and a split-K decode path when T == S. Both take their launch shapes from tensor
shapes only, never from tensor values, so they can be captured in CUDA graphs.

A quantized cache (float8_e4m3fn, int8: see kv_cache.py) is read as cache.float() * scale, with per-layer
k_scale, v_scale ([1] float32). The Triton kernels read such caches too, the scales from device memory (the
kernels fold them out of the dots: see triton_attention.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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
from .kv_cache import KV_CACHE_DTYPES, check_kv_scales
from .step_plan import KeyGroup, PagedAttentionPlan, StepPlan
from .tree_mask import TREE_SPAN, tree_visibility


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    plan = PagedAttentionPlan(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    return _planned_attention(q, (k_cache, k_scale), (v_cache, v_scale), plan, scale, sliding_window, softcap,
                              sinks, tree_mask)


# A cache and its dequantization scale ([1] float32), None for a float cache.
ScaledCache = tuple[torch.Tensor, torch.Tensor | None]


def _read(cache: ScaledCache, reads: torch.Tensor | slice, sequences: int) -> torch.Tensor:
    # cache: [N, block_size, Hk, D] (and its scale); reads (KeyGroup.keys): [B * Hk * L] int64, rows of the
    # cache viewed as [N * block_size * Hk, D], or a slice of one sequence's consecutive slots
    # -> [B, Hk, L, D] float32, contiguous per head where copied
    values, scale = cache
    kv_heads, dim = values.shape[2:]
    if isinstance(reads, slice):  # read in place: a view of the cache where it is float32
        out = values.view(-1, kv_heads, dim)[reads].transpose(0, 1)[None].float()
    else:
        # index_select copies whole rows (D contiguous values each), where advanced indexing copies element by
        # element; one KV head's keys come out contiguous, as attention reads them.
        out = values.view(-1, dim).index_select(0, reads).float().view(sequences, kv_heads, -1, dim)
    if scale is not None:  # a quantized cache: out is a fresh float32 copy, scaled in place
        out.mul_(scale)
    return out


def _planned_attention(q: torch.Tensor, k_cache: ScaledCache, v_cache: ScaledCache, plan: PagedAttentionPlan,
                       scale: float, sliding_window: int, softcap: float = 0.0,
                       sinks: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    # Math in float32, as torch's scaled_dot_product_attention (what transformers runs on the CPU) does it.
    if tree_mask is not None:
        return _tree_attention(q, k_cache, v_cache, plan, scale, sliding_window, softcap, sinks, tree_mask)
    if plan.decode_only:  # T == S: the decode rows are the output
        return _decode_attention(q, k_cache, v_cache, plan.decode, scale, sliding_window, softcap, sinks)
    out = q.new_empty(q.shape)
    if plan.decode is not None:
        out[plan.decode_rows] = _decode_attention(q[plan.decode_rows], k_cache, v_cache, plan.decode, scale,
                                                  sliding_window, softcap, sinks)
    for rows, group in plan.chunks:
        out[rows] = _chunk_attention(q[rows], k_cache, v_cache, group, scale, sliding_window, softcap, sinks)
    return out


def _tree_attention(q: torch.Tensor, k_cache: ScaledCache, v_cache: ScaledCache, plan: PagedAttentionPlan,
                    scale: float, sliding_window: int, softcap: float, sinks: torch.Tensor | None,
                    tree_mask: torch.Tensor) -> torch.Tensor:
    # The causal plan for every sequence, then the sequences with tree queries again under their dense tree
    # mask (tree_mask.py): a rare step (speculative tree drafts), kept simple rather than fast.
    out = _planned_attention(q, k_cache, v_cache, plan, scale, sliding_window, softcap, sinks)
    bits, starts, lens = tree_mask.tolist(), plan.query_start_loc.tolist(), plan.seq_lens.tolist()
    kv_heads, dim = k_cache[0].shape[2:]
    for s, seq_len in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        if not any(bits[lo:hi]) or seq_len == 0:
            continue
        allowed = tree_visibility(tree_mask[lo:hi], seq_len)  # [n, L]
        if sliding_window > 0:  # the window in key indices, as for causal rows
            keys = torch.arange(seq_len, device=q.device)
            allowed &= keys[None, :] > torch.arange(seq_len - (hi - lo), seq_len, device=q.device)[:, None] - \
                sliding_window
        positions = torch.arange(seq_len, device=q.device)
        table = plan.block_tables[s].long()
        slots = table[positions // plan.block_size] * plan.block_size + positions % plan.block_size  # [L]
        reads = (slots[:, None] * kv_heads + torch.arange(kv_heads, device=q.device)[None, :]).T.reshape(-1)
        k, v = _read(k_cache, reads, 1), _read(v_cache, reads, 1)  # [1, Hk, L, D]
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=q.device)
        mask = mask.masked_fill_(~allowed, float("-inf"))[None, None]  # [1, 1, n, L]
        head_sinks = None if sinks is None else sinks.view(1, -1, 1, 1)
        rows = _attend(q[lo:hi].float().transpose(0, 1)[None], k, v, mask, scale, softcap, head_sinks)
        out[lo:hi] = rows[0].transpose(0, 1).to(q.dtype)  # [n, Hq, D]
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    # q: [B, Hq, n, D]; k, v: [B, Hk, L, D], all float32; mask: [B, 1, n, L] additive float32, None for all keys;
    # sinks: float32 broadcastable to [B, Hq, n, 1], None for none
    # -> [B, Hq, n, D]: softmax(capped((q . k) * scale) + mask) @ v; GQA without copying k and v.
    if softcap > 0 or sinks is not None:
        return _attend_softcapped(q, k, v, mask, scale, softcap, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _attend_softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float, softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    # Gemma 2's logit soft-capping, in transformers' order (its eager attention; SDPA has no such option):
    # scores = softcap * tanh(scores / softcap) before the mask and the softmax (softcap 0: none). GPT-OSS's
    # attention sinks likewise: each head's sink joins the softmax as one more score of no value (transformers
    # concatenates it as a last column and drops that column's probability). Shapes as _attend.
    batch, heads, n, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads * n, dim)  # a KV head's query heads share its keys
    scores = (grouped @ k.transpose(-1, -2) * scale).view(batch, heads, n, -1)  # [B, Hq, n, L]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        probs = torch.cat([scores, sinks.expand(batch, heads, n, 1)], dim=-1).softmax(-1)[..., :-1]
    probs = probs.reshape(batch, kv_heads, heads // kv_heads * n, -1)
    return (probs @ v).view(batch, heads, n, dim)


def _chunk_attention(q: torch.Tensor, k_cache: ScaledCache, v_cache: ScaledCache, group: KeyGroup,
                     scale: float, sliding_window: int, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's n query tokens (its last n positions) over its keys: q: [n, Hq, D] -> same."""
    reads, mask = group.keys(sliding_window, k_cache[0].shape[2])
    k = _read(k_cache, reads, 1)  # [1, Hk, L, D]
    v = _read(v_cache, reads, 1)
    head_sinks = None if sinks is None else sinks.view(1, -1, 1, 1)  # [1, Hq, 1, 1]
    out = _attend(q.float().transpose(0, 1)[None], k, v, mask, scale, softcap, head_sinks)  # [1, Hq, n, D]
    return out[0].transpose(0, 1).to(q.dtype)


def _decode_attention(q: torch.Tensor, k_cache: ScaledCache, v_cache: ScaledCache, group: KeyGroup, scale: float,
                      sliding_window: int, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """B sequences of one query token each, keys padded to the longest: q: [B, Hq, D] -> [B, Hq, D],
    contiguous. A sequence of seq_len 0 (a padding row) gives zeros."""
    if group.longest == 0:
        return q.new_zeros(q.shape)
    batch, heads, dim = q.shape
    kv_heads = k_cache[0].shape[2]
    reads, mask = group.keys(sliding_window, kv_heads)
    k = _read(k_cache, reads, batch)  # [B, Hk, L, D]
    v = _read(v_cache, reads, batch)
    # One query per sequence: the Hq // Hk query heads of a KV head attend as that head's Hq // Hk queries
    # ([B, Hk, G, D], heads h -> h // G as GQA maps them), so the keys and values are read once, where
    # enable_gqa would expand them G times (half the CPU time of a decode batch's attention).
    grouped = q.float().view(batch, kv_heads, heads // kv_heads, dim)  # [B, Hk, G, D]
    head_sinks = None if sinks is None else sinks.view(1, kv_heads, heads // kv_heads, 1)  # as grouped's heads
    out = _attend(grouped, k, v, mask, scale, softcap, head_sinks).reshape(batch, heads, dim)
    if min(group.lens) == 0:  # a row with no key to attend to is NaN after the softmax
        out = out.nan_to_num_(0.0)
    return out.to(q.dtype).contiguous()  # [B, Hq, D]


def _paged_attention_fake(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
                          k_scale=None, v_scale=None, softcap=0.0, sinks=None, tree_mask=None):
    return q.new_empty(q.shape)


PAGED_ATTENTION = OpSpec("kiln::paged_attention", """
    Tensor q                  [T, Hq, D] float32 / float16 / bfloat16, last dim contiguous
    Tensor k_cache            [N, block_size, Hk, D] float, or float8_e4m3fn / int8 (quantized); contiguous
    Tensor v_cache            [N, block_size, Hk, D] k_cache's dtype, contiguous
    Tensor block_tables       [S, max_blocks] int32, each sequence's cache blocks
    Tensor seq_lens           [S] int32, each sequence's keys (cached prefix + this step's tokens)
    Tensor query_start_loc    [S + 1] int32, sequence s's queries are q[loc[s]:loc[s + 1]]
    float scale               multiplies q . k
    SymInt sliding_window     > 0: a query sees its last sliding_window keys; 0: all
    Tensor? k_scale=None      [1] float32 for a quantized cache: keys are k_cache.float() * k_scale
    Tensor? v_scale=None      [1] float32, likewise for values
    float softcap=0.0         > 0: scores (q . k * scale) become softcap * tanh(scores / softcap); 0: off
    Tensor? sinks=None        [Hq] float32, contiguous: each head's sink logit joins its softmax (GPT-OSS)
    Tensor? tree_mask=None    [T] int64, contiguous: per query, the keys it sees at its sequence's end (tree_mask.py)
    -> Tensor                 [T, Hq, D] q's dtype, contiguous
    """, reference=paged_attention_reference, fake=_paged_attention_fake,
    kernel="triton_attention.paged_attention_triton")
_paged_attention = define(PAGED_ATTENTION)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
    *,
    plan: StepPlan | None = None,
) -> torch.Tensor:
    """Causal attention of the packed queries q: [T, Hq, D] over the paged cache; returns [T, Hq, D].

    sliding_window > 0 limits each query to the last `sliding_window` keys (itself included). softcap > 0 caps
    each score s = (q . k) * scale as softcap * tanh(s / softcap) before the mask and the softmax (Gemma 2).
    sinks ([Hq] float32, GPT-OSS's attention sinks): head h's softmax has exp(sinks[h]) added to its denominator,
    as one more key of logit sinks[h] whose value is zero; a row with no key then gives zeros.
    tree_mask ([T] int64, tree drafts): a query's row other than 0 says which of its sequence's last TREE_SPAN
    keys it sees (bit j: key seq_len - 1 - j; tree_mask.py), keys before those always; 0 is causal.
    A float8_e4m3fn or int8 cache needs k_scale, v_scale ([1] float32 on its device): keys are read as
    k_cache.float() * k_scale, values likewise; a float cache takes no scales.
    q may be a strided view (e.g. a slice of the fused qkv output) but its last dim must be contiguous;
    k_cache, v_cache must be contiguous. A sequence with seq_lens[s] == 0 (a padding row of a captured
    graph) gives zeros. Precondition: every sequence has at least one query token, so that T == S means
    one token each: such batches take the GPU's split-K decode path, which relies on it.

    `plan`: the step's `StepPlan` of these block_tables, seq_lens, query_start_loc (`ForwardContext.plan`, None
    where the GPU kernels run); the reference reads it instead of working the metadata out again in each layer.
    """
    for name, t, nd in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4),
                        ("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1),
                        ("query_start_loc", query_start_loc, 1)):
        check_dims(name, t, nd)
    check_dtype("q", q, FLOAT_DTYPES)
    check_dtype("k_cache", k_cache, KV_CACHE_DTYPES)
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
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap}")
    check_kv_scales(k_cache, k_scale, v_scale)
    if sinks is not None:
        check_dims("sinks", sinks, 1)
        check_dtype("sinks", sinks, (torch.float32,))
        check_size("sinks", sinks, 0, q.shape[1], "query heads of q")
        if not sinks.is_contiguous():
            raise ValueError(f"sinks must be contiguous, got strides {sinks.stride()}")
        check_same_device(q=q, sinks=sinks)
    if tree_mask is not None:
        check_dims("tree_mask", tree_mask, 1)
        check_dtype("tree_mask", tree_mask, (torch.int64,))
        check_size("tree_mask", tree_mask, 0, q.shape[0], f"query tokens of q (tree regions span <= {TREE_SPAN})")
        if not tree_mask.is_contiguous():
            raise ValueError(f"tree_mask must be contiguous, got strides {tree_mask.stride()}")
        check_same_device(q=q, tree_mask=tree_mask)
    if not runs_reference_directly(q):
        return _paged_attention.for_tensor(q)(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                              float(scale), int(sliding_window), k_scale, v_scale, float(softcap),
                                              sinks, tree_mask)
    if plan is None:
        attention = PagedAttentionPlan(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    elif plan.attention.describes(block_tables, seq_lens, query_start_loc, k_cache.shape[1]):
        attention = plan.attention
    else:
        raise ValueError("plan was made for other block_tables, seq_lens, query_start_loc or block size")
    check_size("q", q, 0, attention.num_tokens, "query tokens in query_start_loc")
    return _planned_attention(q, (k_cache, k_scale), (v_cache, v_scale), attention, float(scale),
                              int(sliding_window), float(softcap), sinks, tree_mask)
