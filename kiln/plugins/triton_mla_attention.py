"""kiln::mla_attention on CUDA: absorbed multi-head latent attention over the paged latent cache.

One kernel for every step. A program takes BLOCK_Q consecutive query tokens of one sequence (the tile -> sequence
map as triton_attention's unified kernel finds it, without a host sync) times BLOCK_H heads (see _launch): rows r are token
r // BLOCK_H, head r % BLOCK_H of the block. Every head reads the same cached rows (MQA), so a tile of BLOCK_N
keys is loaded once per program as its latent part c [BLOCK_N, R] and rope part k_pe [BLOCK_N, P]; the scores
are q_lat . c + q_pe . k_pe (two dots: R + P = 576 is not padded to 1024) and the output accumulates p @ c
(the same tile: MLA's values are its keys' latents). Decode steps (one token per sequence, BLOCK_Q = 1) split
each sequence's keys over NUM_SPLITS programs, whose partial outputs triton_attention's merge kernel combines.
Launch shapes come from tensor shapes only (CUDA graphs replay them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import sm_count as _sm_count
from .triton_attention import LOG2E, _merge_splits_kernel, _sequence_of_tile

_M_INIT = tl.constexpr(-1.0e30)
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 32


@triton.jit(do_not_specialize=["num_seqs", "num_tiles"])
def _mla_kernel(q_lat_ptr, q_pe_ptr, cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, block_tables_ptr, seq_lens_ptr,
                query_start_loc_ptr, qk_scale, num_seqs, num_tiles, stride_ql_tok, stride_ql_head, stride_qp_tok,
                stride_qp_head, stride_o_tok, stride_o_head, stride_table,
                NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    tile = num_tiles - 1 - tl.program_id(0)  # last tiles (the most keys) start first
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq = _sequence_of_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_queries = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_q = (tile - q_start // BLOCK_Q - seq) * BLOCK_Q  # this tile's first query within the sequence
    if first_q >= num_queries:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - num_queries + first_q
    last_pos = first_pos + tl.minimum(num_queries - first_q, BLOCK_Q) - 1

    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    q_idx = offs_m // BLOCK_H
    head = head_block * BLOCK_H + offs_m % BLOCK_H
    row_ok = (q_idx < BLOCK_Q) & (first_q + q_idx < num_queries) & (head < NUM_HEADS)
    q_pos = tl.minimum(first_pos + q_idx, last_pos)  # padding rows borrow a real row's position
    token = (q_start + first_q + q_idx).to(tl.int64)
    r_mask = row_ok[:, None] & (offs_r[None, :] < RANK)
    q_lat = tl.load(q_lat_ptr + token[:, None] * stride_ql_tok + head[:, None] * stride_ql_head + offs_r[None, :],
                    mask=r_mask, other=0.0).to(cache_ptr.dtype.element_ty)  # [BLOCK_M, BLOCK_R]
    q_pe = tl.load(q_pe_ptr + token[:, None] * stride_qp_tok + head[:, None] * stride_qp_head + offs_p[None, :],
                   mask=row_ok[:, None] & (offs_p[None, :] < ROPE), other=0.0).to(cache_ptr.dtype.element_ty)

    # This split's share of the keys [0, last_pos]: BLOCK_N-aligned parts, the last ones possibly empty.
    key_hi = last_pos + 1
    per_split = tl.cdiv(tl.cdiv(key_hi, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, key_hi)
    num_steps = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)

    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    for step in range(0, num_steps):
        k_pos = start + step * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        key_ok = k_pos < end
        block = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=key_ok, other=0)
        row = (block.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE) * (RANK + ROPE)  # [BLOCK_N]
        c = tl.load(cache_ptr + row[:, None] + offs_r[None, :], mask=key_ok[:, None] & (offs_r[None, :] < RANK),
                    other=0.0)  # [BLOCK_N, BLOCK_R]
        k_pe = tl.load(cache_ptr + row[:, None] + RANK + offs_p[None, :],
                       mask=key_ok[:, None] & (offs_p[None, :] < ROPE), other=0.0)  # [BLOCK_N, BLOCK_P]
        scores = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        visible = key_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows with no key (seq_len 0 padding) give zeros
    if NUM_SPLITS == 1:
        tl.store(out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=r_mask)
    else:  # decode: token == seq; parts [S, H, NUM_SPLITS, RANK] and their log2-sum-exp, -inf for an empty split
        part = (seq * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * RANK + offs_r[None, :], out, mask=r_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_ok)


def _launch(num_tokens: int, num_seqs: int, num_heads: int, rank: int, element_size: int, max_context: int,
            num_sms: int) -> dict[str, int]:
    """Tile sizes and split count from shapes only. bf16 / fp16: up to 32 rows a program (heads of one decode
    token; tokens x heads in prefill), each key tile read once for all of them; with R = 512 the fp32
    accumulator takes 64 registers a thread and the query tile 32 (8 warps), the c tile (32 x 512) 32 KB a
    stage. Not tuned on a GPU yet. fp32 caches (tests) run tf32x3 dots: 16-row tiles."""
    decode = num_tokens == num_seqs
    if element_size == 4:
        block_h, block_q, block_n, num_stages = 16, 1, 16, 1
    else:
        block_h = min(32, max(16, triton.next_power_of_2(num_heads)))  # tl.dot needs >= 16 rows
        block_q = 1 if decode else 32 // block_h
        block_n, num_stages = 32, 2
    block_m = block_h * block_q
    cfg = dict(BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, num_stages=num_stages,
               num_warps=4 if block_m * triton.next_power_of_2(rank) <= 16 * 256 else 8, NUM_SPLITS=1)
    if decode:  # memory-bound: split the keys until ~2 programs per SM
        programs = num_seqs * triton.cdiv(num_heads, block_h)
        splits = min(-(-2 * num_sms // programs), max_context // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS)
        cfg["NUM_SPLITS"] = max(splits, 1)
    return cfg


def mla_attention_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """`mla_attention_reference` on the GPU. q_lat: [T, H, R]; q_pe: [T, H, P]; cache: [N, block_size, 1, R + P]
    -> [T, H, R]."""
    num_tokens, num_heads, rank = q_lat.shape
    rope = q_pe.shape[2]
    num_seqs, block_size = seq_lens.shape[0], cache.shape[1]
    out = q_lat.new_zeros(q_lat.shape)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = _launch(num_tokens, num_seqs, num_heads, rank, cache.element_size(), block_tables.shape[1] * block_size,
                  _sm_count(q_lat.device))
    splits = cfg["NUM_SPLITS"]
    part_out = torch.empty((num_seqs, num_heads, splits, rank) if splits > 1 else (0,), dtype=torch.float32,
                           device=q_lat.device)
    part_lse = torch.empty((num_seqs, num_heads, splits) if splits > 1 else (0,), dtype=torch.float32,
                           device=q_lat.device)
    num_tiles = num_tokens // cfg["BLOCK_Q"] + num_seqs
    grid = (num_tiles, triton.cdiv(num_heads, cfg["BLOCK_H"]), splits)
    _mla_kernel[grid](
        q_lat, q_pe, cache, out, part_out, part_lse, block_tables, seq_lens, query_start_loc, scale * LOG2E,
        num_seqs, num_tiles, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0),
        out.stride(1), block_tables.stride(0), NUM_HEADS=num_heads, RANK=rank, ROPE=rope,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_P=max(16, triton.next_power_of_2(rope)), BLOCK_SIZE=block_size,
        DOT_PRECISION="tf32x3" if cache.dtype == torch.float32 else "tf32", **cfg)
    if splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=rank,
            NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(rank),
            num_warps=4)
    return out
