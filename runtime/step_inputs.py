"""Packing one scheduled step into the tensors the network reads.

Tokens of all scheduled requests go into one flat batch (no padding); attention finds each request's
keys through its block table. The slot and rope-length arithmetic lives here once, for the eager step,
the CUDA-graph decode batch and the profiling step alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.model_defs.layers import ForwardContext

from .host_tensors import to_device
from .kv_cache import LayerCache, LayerScales
from .scheduler import SchedulerOutput


def slot_of(block_ids: Sequence[int], position: int, block_size: int) -> int:
    """The KV-cache slot (block * block_size + offset) of a sequence's token at `position`."""
    return block_ids[position // block_size] * block_size + position % block_size


def rope_length(position: int, num_prompt_tokens: int) -> int:
    """The sequence length dynamic-NTK rope scales for at `position`: what Hugging Face uses when it
    generates one sequence, max(position + 1, prompt length)."""
    return max(position + 1, num_prompt_tokens)


@dataclass(frozen=True)
class PackedStep:
    """One step's network inputs on the runtime device."""

    input_ids: torch.Tensor  # [T] int64: the packed tokens of every scheduled request
    context: ForwardContext
    sample_rows: torch.Tensor  # [R] int64: rows of the hidden states whose logits are sampled
    # Per scheduled request, where its sampled rows start among the R rows; the last entry is R.
    logits_offsets: tuple[int, ...]


def build_context(*, positions: list[int], rope_lengths: list[int], slots: list[int],
                  tables: Sequence[Sequence[int]], query_lens: Sequence[int],
                  kv_caches: tuple[LayerCache, ...], device: torch.device,
                  kv_scales: tuple[LayerScales, ...] | None = None) -> ForwardContext:
    """A ForwardContext from host lists; each sequence's length after the step is its table's start
    position plus its query length, given here through `positions` (the last one of each sequence).
    `kv_scales`: the cache's per-layer (k_scale, v_scale) device tensors (`KVCache.scales`), None for a
    float cache."""
    width = max(len(t) for t in tables)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    seq_lens = [positions[end - 1] + 1 for end in starts[1:]]
    return ForwardContext(
        positions=to_device(positions, torch.int64, device),
        rope_lengths=to_device(rope_lengths, torch.int64, device),
        slot_mapping=to_device(slots, torch.int64, device),
        block_tables=to_device([list(t) + [0] * (width - len(t)) for t in tables], torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        query_start_loc=to_device(starts, torch.int32, device),
        kv_caches=kv_caches,
        max_rope_length=max(rope_lengths),
        kv_scales=kv_scales,
    )


def pack_step(step: SchedulerOutput, block_size: int, kv_caches: tuple[LayerCache, ...],
              device: torch.device, kv_scales: tuple[LayerScales, ...] | None = None) -> PackedStep:
    """The step's tokens, positions, slots and block tables as device tensors, and which rows to sample:
    the last `num_sampled` positions of each request. `kv_scales` as for `build_context`."""
    input_ids: list[int] = []
    positions: list[int] = []
    rope_lengths: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    offsets = [0]
    end = 0
    for r in step.requests:
        span = range(r.start_position, r.start_position + len(r.token_ids))
        input_ids.extend(r.token_ids)
        positions.extend(span)
        rope_lengths.extend(rope_length(p, r.num_prompt_tokens) for p in span)
        slots.extend(slot_of(r.block_ids, p, block_size) for p in span)
        end += len(span)
        sample_rows.extend(range(end - r.num_sampled, end))
        offsets.append(len(sample_rows))
    context = build_context(positions=positions, rope_lengths=rope_lengths, slots=slots,
                            tables=[r.block_ids for r in step.requests],
                            query_lens=[len(r.token_ids) for r in step.requests], kv_caches=kv_caches,
                            device=device, kv_scales=kv_scales)
    return PackedStep(to_device(input_ids, torch.int64, device), context,
                      to_device(sample_rows, torch.int64, device), tuple(offsets))
