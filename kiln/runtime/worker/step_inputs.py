"""Packing one scheduled step into the tensors the network reads.

Tokens of all scheduled requests go into one flat batch (no padding); attention finds each request's
keys through its block table. The slot and rope-length arithmetic lives here once, for the eager step,
the CUDA-graph decode batch and the profiling step alike.

The host's work per request is what the step adds: its tokens' ids, positions, slots and rope lengths are
made a block or a run at a time, and block tables come from a `BlockTableMirror`, which writes only the
blocks a table gained since it last saw it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kiln.model_defs.layers import ForwardContext
from kiln.plugins.host_tensors import array_to_device, to_device
from kiln.runtime.core.scheduler import SchedulerOutput
from kiln.runtime.worker.block_table_mirror import BlockTableMirror
from kiln.runtime.worker.kv_cache import LayerCache, LayerScales
from kiln.runtime.worker.model_step import TokenFeed
from kiln.runtime.worker.tree_rows import tree_rows


def slot_of(block_ids: Sequence[int], position: int, block_size: int) -> int:
    """The KV-cache slot (block * block_size + offset) of a sequence's token at `position`."""
    return block_ids[position // block_size] * block_size + position % block_size


def slots_of(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """slot_of for the positions start..end-1, a block at a time."""
    if end - start == 1:
        return [slot_of(block_ids, start, block_size)]
    slots: list[int] = []
    for b in range(start // block_size, (end - 1) // block_size + 1):
        first = b * block_size
        base = block_ids[b] * block_size - first
        slots.extend(range(base + max(start, first), base + min(end, first + block_size)))
    return slots


def rope_length(position: int, num_prompt_tokens: int) -> int:
    """The sequence length dynamic-NTK rope scales for at `position`: what Hugging Face uses when it
    generates one sequence, max(position + 1, prompt length)."""
    return max(position + 1, num_prompt_tokens)


def rope_lengths_of(start: int, end: int, num_prompt_tokens: int) -> list[int]:
    """rope_length for the positions start..end-1: the prompt length up to position num_prompt_tokens - 1,
    then position + 1."""
    flat = min(max(num_prompt_tokens - start, 0), end - start)
    return [num_prompt_tokens] * flat + list(range(start + flat + 1, end + 1))


# The eager step's mirror of block tables, one per thread (each engine steps from one thread; a mirror is
# correct for any tables, since it keys rows by the tables' process-unique stamps, so engines may share one).
_mirrors = threading.local()


def step_mirror() -> BlockTableMirror:
    """This thread's BlockTableMirror for packed steps."""
    mirror = getattr(_mirrors, "mirror", None)
    if mirror is None:
        mirror = _mirrors.mirror = BlockTableMirror()
    return mirror


@dataclass(frozen=True)
class PackedStep:
    """One step's network inputs on the runtime device."""

    input_ids: torch.Tensor  # [T] int64: the packed tokens of every scheduled request
    context: ForwardContext
    sample_rows: torch.Tensor  # [R] int64: rows of the hidden states whose logits are sampled
    # Per scheduled request, where its sampled rows start among the R rows; the last entry is R.
    logits_offsets: tuple[int, ...]


def build_context(*, positions: list[int], rope_lengths: list[int], slots: list[int],
                  tables: Sequence[Sequence[int]] | np.ndarray, query_lens: Sequence[int],
                  kv_caches: tuple[LayerCache, ...], device: torch.device,
                  kv_scales: tuple[LayerScales, ...] | None = None, seq_lens: Sequence[int] | None = None,
                  tree_mask: Sequence[int] | None = None) -> ForwardContext:
    """A ForwardContext from host lists; each sequence's length after the step is its table's start
    position plus its query length, given here through `positions` (the last one of each sequence).
    `tables`: each sequence's block ids, or already padded into an int32 array [S, width] (what
    `BlockTableMirror.gather` makes). `kv_scales`: the cache's per-layer (k_scale, v_scale) device tensors
    (`KVCache.scales`), None for a float cache. Tree drafts, whose positions are not their keys' indices: each
    sequence's key count `seq_lens` and every token's `tree_mask` (plugins/tree_mask.py). The per-sequence
    query and key counts are kept on the host too (`ForwardContext.host_query_lens`, `host_seq_lens`)."""
    if not isinstance(tables, np.ndarray):
        tables = BlockTableMirror().gather(tables)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    if seq_lens is None:
        seq_lens = [positions[end - 1] + 1 for end in starts[1:]]
    return ForwardContext(
        positions=to_device(positions, torch.int64, device),
        rope_lengths=to_device(rope_lengths, torch.int64, device),
        slot_mapping=to_device(slots, torch.int64, device),
        block_tables=array_to_device(tables, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        query_start_loc=to_device(starts, torch.int32, device),
        kv_caches=kv_caches,
        max_rope_length=max(rope_lengths),
        kv_scales=kv_scales,
        tree_mask=None if tree_mask is None else to_device(tree_mask, torch.int64, device),
        host_query_lens=tuple(query_lens),
        host_seq_lens=tuple(seq_lens),
    )


def pack_step(step: SchedulerOutput, block_size: int, kv_caches: tuple[LayerCache, ...],
              device: torch.device, kv_scales: tuple[LayerScales, ...] | None = None,
              mirror: BlockTableMirror | None = None) -> PackedStep:
    """The step's tokens, positions, slots and block tables as device tensors, and which rows to sample:
    the last `num_sampled` positions of each request. `kv_scales` as for `build_context`; `mirror`: where the
    block tables are kept between steps (default: this thread's `step_mirror()`)."""
    input_ids: list[int] = []
    positions: list[int] = []
    rope_lengths: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    offsets = [0]
    query_lens: list[int] = []
    # Tree drafts being verified (a rare step): every token's tree mask, 0 for causal ones (tree_rows.py).
    tree_masks: list[int] | None = [] if any(r.draft_parents for r in step.requests) else None
    end = 0
    for r in step.requests:
        n = len(r.token_ids)
        start, stop = r.start_position, r.start_position + n
        input_ids.extend(r.token_ids)
        if r.draft_parents:  # a tree's nodes: rope positions start + depth, keys start..stop-1 as always
            mine, masks = tree_rows(r)
            positions.extend(mine)
            rope_lengths.extend(rope_length(p, max(r.num_prompt_tokens, r.rope_min_length)) for p in mine)
            tree_masks.extend(masks)
        else:
            positions.extend(range(start, stop))
            rope_lengths.extend(rope_lengths_of(start, stop, max(r.num_prompt_tokens, r.rope_min_length)))
            if tree_masks is not None:
                tree_masks.extend([0] * n)
        slots.extend(slots_of(r.block_ids, start, stop, block_size))
        end += n
        sample_rows.extend(range(end - r.num_sampled, end))
        offsets.append(len(sample_rows))
        query_lens.append(n)
    tables = (mirror if mirror is not None else step_mirror()).gather([r.block_ids for r in step.requests])
    trees = {} if tree_masks is None else {  # a tree's last position is not its key count
        "tree_mask": tree_masks, "seq_lens": [r.start_position + len(r.token_ids) for r in step.requests]}
    context = build_context(positions=positions, rope_lengths=rope_lengths, slots=slots, tables=tables,
                            query_lens=query_lens, kv_caches=kv_caches, device=device, kv_scales=kv_scales, **trees)
    return PackedStep(to_device(input_ids, torch.int64, device), context,
                      to_device(sample_rows, torch.int64, device), tuple(offsets))


def feed_tokens(input_ids: torch.Tensor, step: SchedulerOutput, feed: TokenFeed) -> None:
    """Async scheduling: writes the previous step's sampled tokens over the PLACEHOLDER inputs of a packed
    step, on the device (no wait): request i's last packed token becomes feed.tokens[feed.rows[i]] where
    feed.rows[i] >= 0. input_ids: [T] int64, `pack_step`'s."""
    index: list[int] = []
    rows: list[int] = []
    end = 0
    for r, row in zip(step.requests, feed.rows, strict=True):
        end += len(r.token_ids)
        if row >= 0:
            index.append(end - 1)
            rows.append(row)
    if index:
        device = input_ids.device
        fed = feed.tokens.index_select(0, to_device(rows, torch.int64, device))  # [F]
        input_ids.index_copy_(0, to_device(index, torch.int64, device), fed)
