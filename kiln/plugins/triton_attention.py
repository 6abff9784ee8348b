"""Triton kernels for `kiln::paged_attention` (semantics: plugins/attention.py).

Two paths, picked from shapes only so that a captured CUDA graph replays the same launches:
- unified (any batch): a program owns BLOCK_Q query tokens of one sequence and one kv head, and computes
  the GROUP = Hq / Hk query heads of that kv head together, so each key tile is loaded once for
  BLOCK_Q * GROUP query rows. Programs find their sequence by binary search on the GPU (no host sync).
- decode (T == S, one token per sequence): flash-decoding. Programs (sequence, kv head, split) each
  cover one contiguous part of the keys and, when there is more than one split, write an fp32 partial
  output and its log-sum-exp, which a second kernel merges.
Keys are gathered through the block table one position at a time, so BLOCK_N does not depend on the
cache block size. Scores use exp2 with scale * log2(e) folded into one multiply; soft-capping (Gemma 2,
SOFTCAP) caps them in those log2 units, the cap scaled by log2(e) likewise, before the masks.

A quantized cache (KV_QUANT: float8_e4m3fn or int8) holds k / k_scale and v / v_scale. Its tiles are
converted to q's dtype, exactly (every float8_e4m3fn value and every int8 is a float16 and a bfloat16 number),
and the dots run on the stored values as with a float cache; the scales multiply outside the dots, where
linearity makes that the same math: (q . k) * k_scale is one multiply folded into qk_scale, and
(p @ v) * v_scale one multiply of the normalized output. Against the reference's dequantize-first
(cache.float() * scale, then float32 attention) that only moves each score and output by float32 roundings
(relative 2**-24 each), far below the bfloat16 / float16 rounding of p and of the output that the float
path already has. The scales are read on the GPU (CUDA graphs replay the launches); a float cache compiles
without any of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._triton import sm_count as _sm_count

LOG2E = 1.4426950408889634
# The running max starts finite: a row whose keys are all masked so far keeps exp2(-inf - m) = 0 and
# alpha = 1 instead of the NaN that -inf - -inf would give.
_M_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _attend_tile(acc, l_i, m_i, q, k_ptr, v_ptr, table_ptr, kv_head, start, key_end, q_pos, window, qk_scale,
                 softcap, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KEYS: tl.constexpr, CAUSAL: tl.constexpr,
                 USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr,
                 SOFTCAP: tl.constexpr, tree_bits=None, seq_len=None, TREE: tl.constexpr = False):
    """One online-softmax step over keys [start, start + BLOCK_N). MASK_KEYS drops keys >= key_end (never
    read); CAUSAL drops, per row, keys after q_pos and (USE_WINDOW) keys <= q_pos - window. Tiles known
    to be fully visible skip both. KV_QUANT: the cache holds unscaled float8 / int8 values (qk_scale has
    k_scale in it; the caller multiplies the output by v_scale). SOFTCAP: scores are capped before the masks,
    `softcap` being the cap times log2(e) (see _cap). TREE (with CAUSAL): a row whose tree_bits ([BLOCK_M]
    int64) are not 0 sees, of its sequence's last 64 keys (seq_len being its key count), only those whose bit
    (counted back from the last key) is set (tree_mask.py)."""
    # q: [BLOCK_M, BLOCK_D]; acc: [BLOCK_M, BLOCK_D] fp32; l_i, m_i, q_pos: [BLOCK_M]
    k_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)
    key_ok = k_pos < key_end
    if MASK_KEYS:
        block = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=key_ok, other=0)
    else:
        block = tl.load(table_ptr + k_pos // BLOCK_SIZE)
    slot = block.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
    kv_offs = (slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM)[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    load_mask = offs_d[None, :] < HEAD_DIM
    if MASK_KEYS:
        load_mask = load_mask & key_ok[:, None]
    k = tl.load(k_ptr + kv_offs, mask=load_mask, other=0.0)
    if KV_QUANT:
        k = k.to(tl.float32).to(q.dtype)  # exact: see the module docstring
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if SOFTCAP:
        scores = _cap(scores, softcap)
    if CAUSAL:
        visible = k_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        if TREE:
            back = seq_len - 1 - k_pos  # [BLOCK_N]
            bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(back, 0), 63).to(tl.int64)[None, :]) & 1
            visible = visible & ((tree_bits[:, None] == 0) | (back[None, :] >= 64) | (bit != 0))
        scores = tl.where(visible, scores, float("-inf"))
    elif MASK_KEYS:
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + kv_offs, mask=load_mask, other=0.0)
    if KV_QUANT:
        v = v.to(tl.float32).to(q.dtype)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _cap(scores, softcap):
    # Scores here are log2(e) * s for the true score s, so cap * tanh(s / cap) * log2(e) is
    # softcap * tanh(scores / softcap) with softcap = cap * log2(e). tanh(x) = 1 - 2 / (exp(2x) + 1) in float32:
    # exact at +-inf (exp overflows to inf, or to 0), and no libdevice call (the interpreter runs it too).
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))


@triton.jit
def _sink_start(sinks_ptr, head, use):
    # GPT-OSS's attention sinks: the online softmax of rows `use` starts as if it had seen one key of score
    # sinks[head] (in log2 units, as the scores) and value 0: l = 1, m = the sink; other rows start empty.
    # A row with no real key then ends with acc = 0: zeros, as the reference gives.
    sink = tl.load(sinks_ptr + head, mask=use, other=0.0).to(tl.float32) * 1.4426950408889634  # log2(e)
    return tl.where(use, 1.0, 0.0), tl.where(use, sink, _M_INIT)


@triton.jit
def _sequence_of_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    # Sequence s owns tiles [query_start_loc[s] // BLOCK_Q + s, the same for s + 1): at least the
    # ceil(n_s / BLOCK_Q) it needs whatever its start's alignment, and found without a host sync.
    lo = num_seqs * 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        owns = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid - 1)
    return lo


@triton.jit(do_not_specialize=["window", "num_seqs", "num_tiles"])
def _unified_kernel(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                    k_scale_ptr, v_scale_ptr, sinks_ptr, qk_scale, softcap, window, num_seqs, num_tiles,
                    stride_q_tok, stride_q_head,
                    stride_o_tok, stride_o_head, stride_table,
                    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr, SOFTCAP: tl.constexpr,
                    SINKS: tl.constexpr, tree_ptr=None, TREE: tl.constexpr = False):
    pid = tl.program_id(0)
    kv_head = pid % NUM_KV_HEADS
    tile = num_tiles - 1 - pid // NUM_KV_HEADS  # last tiles (the most keys) start first
    seq = _sequence_of_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_queries = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_q = (tile - q_start // BLOCK_Q - seq) * BLOCK_Q  # this tile's first query within the sequence
    if first_q >= num_queries:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - num_queries + first_q
    last_pos = first_pos + tl.minimum(num_queries - first_q, BLOCK_Q) - 1

    # Row r is query token r // GROUP of the tile, head r % GROUP of this kv head's group.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (q_idx < BLOCK_Q) & (first_q + q_idx < num_queries)
    q_pos = tl.minimum(first_pos + q_idx, last_pos)  # padding rows borrow a real row's position
    token = (q_start + first_q + q_idx).to(tl.int64)
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    if KV_QUANT:
        qk_scale = qk_scale * tl.load(k_scale_ptr)  # the dots run in q's dtype
    else:
        q = q.to(k_ptr.dtype.element_ty)  # ... in the cache's

    # Keys some row sees: [key_lo, last_pos]; keys every row sees: [full_lo, first_pos].
    key_hi = last_pos + 1
    if USE_WINDOW:
        key_lo = tl.maximum(first_pos - window + 1, 0)
        full_lo = tl.maximum(last_pos - window + 1, key_lo)
    else:
        key_lo = first_pos * 0
        full_lo = key_lo
    num_steps = tl.cdiv(tl.maximum(key_hi - key_lo, 0), BLOCK_N)
    full_start = tl.minimum(tl.cdiv(full_lo - key_lo, BLOCK_N), num_steps)
    full_end = tl.maximum(tl.minimum(tl.maximum(first_pos + 1 - key_lo, 0) // BLOCK_N, num_steps), full_start)
    tree_bits = offs_m * 0
    if TREE:  # tree rows: the keys of the tree region (the last 64) are masked tiles, never "full" ones
        tree_bits = tl.load(tree_ptr + token, mask=row_ok, other=0)
        full_end = tl.maximum(tl.minimum(full_end, tl.maximum(seq_len - 64 - key_lo, 0) // BLOCK_N), full_start)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    if SINKS:  # the sink is one more score of no value: the softmax starts from it (see _sink_start)
        l_i, m_i = _sink_start(sinks_ptr, head, head >= 0)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    for step in range(0, full_start):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_ptr, v_ptr, table_ptr, kv_head, key_lo + step * BLOCK_N,
                                     key_hi, q_pos, window, qk_scale, softcap, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                     BLOCK_N, BLOCK_D, True, True, USE_WINDOW, DOT_PRECISION, KV_QUANT, SOFTCAP,
                                     tree_bits, seq_len, TREE)
    for step in range(full_start, full_end):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_ptr, v_ptr, table_ptr, kv_head, key_lo + step * BLOCK_N,
                                     key_hi, q_pos, window, qk_scale, softcap, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                     BLOCK_N, BLOCK_D, False, False, USE_WINDOW, DOT_PRECISION, KV_QUANT, SOFTCAP)
    for step in range(full_end, num_steps):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_ptr, v_ptr, table_ptr, kv_head, key_lo + step * BLOCK_N,
                                     key_hi, q_pos, window, qk_scale, softcap, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                     BLOCK_N, BLOCK_D, True, True, USE_WINDOW, DOT_PRECISION, KV_QUANT, SOFTCAP,
                                     tree_bits, seq_len, TREE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows with no key (seq_len 0 padding) give zeros
    if KV_QUANT:
        out = out * tl.load(v_scale_ptr)
    tl.store(out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["window"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_lse_ptr, block_tables_ptr, seq_lens_ptr,
                   k_scale_ptr, v_scale_ptr, sinks_ptr, qk_scale, softcap, window, stride_q_tok, stride_q_head,
                   stride_o_tok,
                   stride_o_head, stride_table,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   KV_QUANT: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    seq = tl.program_id(0)  # == its query token: one token per sequence
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if USE_WINDOW:
        key_lo = tl.maximum(seq_len - window, 0)
    else:
        key_lo = seq_len * 0
    # Splits share the sequence's keys in BLOCK_N-aligned parts; the last ones may be empty.
    per_split = tl.cdiv(tl.cdiv(seq_len - key_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = key_lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    num_steps = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + offs_m
    io_mask = (offs_m[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    if KV_QUANT:
        qk_scale = qk_scale * tl.load(k_scale_ptr)  # the dots run in q's dtype
    else:
        q = q.to(k_ptr.dtype.element_ty)  # ... in the cache's
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    if SINKS:  # in split 0 only: the merge adds the splits' denominators, which must count the sink once
        l_i, m_i = _sink_start(sinks_ptr, head, (offs_m < GROUP) & (offs_m * 0 + split == 0))
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    for step in range(0, num_steps):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_ptr, v_ptr, table_ptr, kv_head, start + step * BLOCK_N,
                                     end, seq_len - 1, window, qk_scale, softcap, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                     BLOCK_N, BLOCK_D, True, False, USE_WINDOW, DOT_PRECISION, KV_QUANT, SOFTCAP)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_QUANT:
        out = out * tl.load(v_scale_ptr)  # the merge of split parts is linear: scaling each part is the same
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq.to(tl.int64) * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        row = (seq * (NUM_KV_HEADS * GROUP) + head).to(tl.int64) * NUM_SPLITS + split  # [S, Hq, NUM_SPLITS]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=io_mask)
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=offs_m < GROUP)  # -inf for an empty split


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_o_tok, stride_o_head,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    row = (seq * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    lse = tl.load(part_lse_ptr + row, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # 0 for empty splits
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=(offs_s[:, None] < NUM_SPLITS) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@dataclass(frozen=True)
class _LaunchConfig:
    block_m: int  # query rows per program (tokens x heads of one kv head): a power of two >= 16
    block_n: int  # keys per loop step
    num_warps: int
    num_stages: int
    num_splits: int  # decode only: key partitions per (sequence, kv head); 1 writes the output directly


_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 32


def _launch_config(num_tokens: int, num_seqs: int, num_kv_heads: int, group: int, head_dim: int,
                   element_size: int, max_context: int, num_sms: int, decode: bool,
                   kv_element_size: int = 2) -> _LaunchConfig:
    """Tile sizes and split count from shapes only (never tensor values: CUDA graphs replay them).
    `element_size`: bytes of the dots' operands; `kv_element_size`: of the cache (1 for FP8 / int8).
    The register and shared-memory figures below are ptxas's for sm_90 with bf16."""
    block_d = triton.next_power_of_2(head_dim)
    min_rows = max(16, triton.next_power_of_2(group))  # tl.dot needs >= 16 rows
    if element_size == 4:
        # fp32 caches (tests, CPU-built engines) run tf32x3 dots, which triple the registers: small tiles.
        block_m, block_n, num_warps, num_stages = min_rows, 16, 4, 2
    else:
        # K and V tiles of block_n x block_d, num_stages deep, fit shared memory beside the query tile
        # (<= 100 KB), and the fp32 accumulator fits registers without spills: halve the tiles for D=256.
        block_n = 64 if block_d <= 128 else 32
        num_stages = 3 if block_d <= 128 else 2
        # Rows = tokens of one sequence x GROUP: sized to the average query count per sequence, so that
        # decode-heavy mixed batches do not compute mostly padding rows.
        rows = triton.next_power_of_2(-(-num_tokens // num_seqs) * group)
        block_m = min_rows if decode else max(min_rows, min(rows, 128 if block_d <= 128 else 64))
        # 4 warps hold a 32 x 128 fp32 accumulator in <= 200 registers a thread; larger tiles need 8.
        num_warps = 4 if block_m * block_d <= 32 * 128 else 8
    if not decode:
        return _LaunchConfig(block_m, block_n, num_warps, num_stages, 1)
    if kv_element_size == 1 and element_size == 2:
        # A 1-byte cache tile is half the bytes of a bf16 one: 2 warps a program let twice the programs
        # share an SM and keep more loads in flight. H100 (scripts/bench_attention.py --sweep, Llama-8B heads):
        # batch 1024 x 192 keys 220 -> 177 us (1.8 -> 2.3 TB/s), 256 x 1024 258 -> 223 us, 64 x 1024 83 -> 66 us;
        # a bf16 cache gains nothing from it.
        num_warps = 2
    # Decode is memory-bound: one program per (sequence, kv head) leaves most SMs idle at small batch, so
    # split the keys until ~2 programs per SM, keeping >= _MIN_KEYS_PER_SPLIT keys of the longest context
    # the table addresses per split (shorter splits cost more in the merge than they save).
    programs = num_seqs * num_kv_heads
    splits = min(-(-2 * num_sms // programs), max_context // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS)
    return _LaunchConfig(block_m, block_n, num_warps, num_stages, max(splits, 1))


def paged_attention_triton(
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
    """`paged_attention_reference` on the GPU; the decode path needs T == S with one token per sequence
    (a step with a tree_mask ([T] int64, tree drafts) always takes the unified kernel).
    q may be strided except in its last dim; k_cache, v_cache must be contiguous. A float8_e4m3fn or int8
    cache comes with k_scale, v_scale ([1] float32 on the device), read by the kernels; sinks ([Hq] float32)
    start each head's online softmax (_sink_start)."""
    # q: [T, Hq, D]; k_cache, v_cache: [N, block_size, Hk, D] -> out: [T, Hq, D]
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs, group = seq_lens.shape[0], num_heads // num_kv_heads
    out = q.new_zeros(q.shape) if num_seqs == 0 else q.new_empty(q.shape)
    if num_tokens == 0 or num_seqs == 0:
        return out
    decode = num_tokens == num_seqs and tree_mask is None
    quantized = k_scale is not None
    dot_dtype = q.dtype if quantized else k_cache.dtype  # what the dots multiply (see the module docstring)
    cfg = _launch_config(num_tokens, num_seqs, num_kv_heads, group, head_dim, dot_dtype.itemsize,
                         block_tables.shape[1] * block_size, _sm_count(q.device), decode, k_cache.element_size())
    shared = dict(NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=triton.next_power_of_2(head_dim),
                  USE_WINDOW=sliding_window > 0, DOT_PRECISION="tf32x3" if dot_dtype == torch.float32 else "tf32",
                  KV_QUANT=quantized, SOFTCAP=softcap > 0, SINKS=sinks is not None, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    qk_scale = scale * LOG2E
    softcap_log2 = softcap * LOG2E  # the cap in the kernels' log2 units (unused when 0)
    # A float cache's kernels never read the scale pointers (KV_QUANT is compile-time): q stands in.
    k_scale, v_scale = (k_scale, v_scale) if quantized else (q, q)
    sinks_arg = q if sinks is None else sinks  # read only when SINKS
    if not decode:
        block_q = cfg.block_m // group
        num_tiles = num_tokens // block_q + num_seqs
        _unified_kernel[(num_tiles * num_kv_heads,)](
            q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, k_scale, v_scale, sinks_arg,
            qk_scale, softcap_log2, sliding_window, num_seqs, num_tiles, q.stride(0), q.stride(1), out.stride(0),
            out.stride(1), block_tables.stride(0), BLOCK_Q=block_q, tree_ptr=q if tree_mask is None else tree_mask,
            TREE=tree_mask is not None, **shared)
        return out
    splits = cfg.num_splits
    part_out = torch.empty((num_seqs, num_heads, splits, head_dim) if splits > 1 else (0,),
                           dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_seqs, num_heads, splits) if splits > 1 else (0,), dtype=torch.float32,
                           device=q.device)
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens, k_scale, v_scale, sinks_arg,
        qk_scale, softcap_log2, sliding_window, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), NUM_SPLITS=splits, **shared)
    if splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
            BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4)
    return out
