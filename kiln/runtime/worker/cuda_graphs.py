"""CUDA graphs of the decode step (one new token per sequence), captured once per batch size.

A decode step launches a few hundred small kernels; replaying a captured graph launches them all with one
call, so the GPU, not Python, sets the pace. A batch of n sequences runs the graph of the smallest
captured size >= n; the extra rows are padding: slot -1 (the KV write skips them) and sequence length 0
(attention reads nothing for them), and their logits are dropped.

Every tensor a graph reads or writes is allocated here once and never reallocated: a graph holds raw
addresses. The host side fills pinned staging buffers (graph_inputs.py), copied to the device buffers before
each replay; the block tables come from a `BlockTableMirror` that writes only the blocks each table gained since the step
before, then gathers the batch's rows into the staging buffer in batch order.

With LoRA adapters (`lora`), each graph also reads a [G] int32 buffer of the rows' adapter slots (-1: the base
model, and every padding row): the LoRA hooks' kernels are captured reading it, so one graph serves any mix of
adapters and the base model (worker/lora_slots.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kiln.model_defs import CausalLM
from kiln.model_defs.layers import ForwardContext
from kiln.runtime.core.scheduler import SchedulerOutput
from kiln.runtime.worker.block_table_mirror import BlockTableMirror
from kiln.runtime.worker.graph_inputs import GraphInputs, OutputBuffer, capture_sizes_into, release_graphs
from kiln.runtime.worker.kv_cache import LayerCache, LayerScales
from kiln.runtime.worker.model_step import TokenFeed
from kiln.runtime.worker.step_inputs import rope_length, slot_of

if TYPE_CHECKING:
    from kiln.runtime.worker.lora_slots import LoRASlots

# A padding row of the int buffers (input_ids, positions, rope_lengths, slot_mapping, feed row): it writes
# nothing.
_PADDING_ROW = np.array([[0], [0], [1], [-1], [-1]], dtype=np.int64)


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 256 and every 64 past it, up to max_batch_size (and max_batch_size
    itself): padding wastes at most 15 rows where a decode step's cost hardly grows with its rows, and at most
    a few percent where it does, while an engine for large batches captures a few dozen graphs, not a hundred
    (each costs startup time; their logits share one [max_batch_size, V] buffer)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size] + list(range(16, min(max_batch_size, 257), 16))
    sizes += list(range(320, max_batch_size, 64))
    return sorted(set(s for s in sizes if s <= max_batch_size) | {max_batch_size})


@dataclass(frozen=True)
class DecodeBatch:
    """One decode step as plain host data: row i is sequence i, whose new token sits at positions[i]."""

    input_ids: Sequence[int]
    positions: Sequence[int]
    rope_lengths: Sequence[int]
    slots: Sequence[int]
    block_tables: Sequence[Sequence[int]]
    # Per row, the row of the previous step's sampled tokens its input token is (async scheduling), -1: none
    feed_rows: Sequence[int] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


def decode_batch(step: SchedulerOutput, block_size: int, model: CausalLM,
                 prompt_logprob_targets: dict[str, list[int]], feed: TokenFeed | None = None) -> DecodeBatch | None:
    """The step as a DecodeBatch when a captured graph can run it: one token computed and sampled per
    request, no prompt logprobs, and rope tables that need no per-length work; else None. `feed`: where
    the PLACEHOLDER input tokens come from (async scheduling)."""
    ids, positions, rope_lengths, slots, tables = [], [], [], [], []
    for r in step.requests:
        if len(r.token_ids) != 1 or r.num_sampled != 1 or r.request_id in prompt_logprob_targets:
            return None
        p = r.start_position
        ids.append(r.token_ids[0])
        positions.append(p)
        rope_lengths.append(rope_length(p, max(r.num_prompt_tokens, r.rope_min_length)))
        slots.append(slot_of(r.block_ids, p, block_size))
        tables.append(r.block_ids)
    if model.needs_per_length_rope(max(rope_lengths)):
        return None
    return DecodeBatch(ids, positions, rope_lengths, slots, tables, feed.rows if feed is not None else None)


class DecodeGraphs:
    """Captured decode steps for `capture_sizes(max_batch_size)`; `run` replays the one that fits."""

    def __init__(self, model: CausalLM, kv_caches: tuple[LayerCache, ...], *,
                 max_batch_size: int, max_blocks_per_seq: int, device: torch.device,
                 kv_scales: tuple[LayerScales, ...] | None = None, lora: LoRASlots | None = None) -> None:
        self.model = model
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = max_batch_size
        g, mb = max_batch_size, max_blocks_per_seq
        # Device buffers read by every graph and their pinned staging (graph_inputs.py):
        # ints: [5, G] int64 rows = input_ids, positions, rope_lengths, slot_mapping, feed rows (the row of
        # _fed whose token replaces the input id, -1: none); seq_lens: [G] int32; tables: [G, MB] int32;
        # with LoRA, lora: [G] int32 each row's adapter slot (-1: none).
        specs = {"ints": ((5, g), torch.int64), "seq_lens": ((g,), torch.int32), "tables": ((g, mb), torch.int32)}
        self._lora = lora
        if lora is not None:
            specs["lora"] = ((g,), torch.int32)
        self._inputs = GraphInputs(specs, device)
        self._ints, self._seq_lens, self._tables = (self._inputs.buffers[k] for k in ("ints", "seq_lens", "tables"))
        self._fed = torch.zeros(g, dtype=torch.int64, device=device)  # [G] the previous step's sampled tokens
        self._query_start_loc = torch.arange(g + 1, dtype=torch.int32, device=device)  # one token per sequence
        # The batch's tables, a row per table kept across steps (rows to spare for requests that come and go).
        self._mirror = BlockTableMirror(2 * g, mb)
        self._kv_caches = kv_caches
        self._kv_scales = kv_scales  # fixed device tensors, like the caches: safe to capture
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits = OutputBuffer(g)  # [G, V] float32: each graph writes its first rows
        self._views: dict[int, torch.Tensor] = {}  # size -> the [size, V] rows that graph writes

    def _context(self, size: int) -> ForwardContext:
        return ForwardContext(
            positions=self._ints[1, :size], rope_lengths=self._ints[2, :size], slot_mapping=self._ints[3, :size],
            block_tables=self._tables[:size], seq_lens=self._seq_lens[:size],
            query_start_loc=self._query_start_loc[:size + 1], kv_caches=self._kv_caches, max_rope_length=0,
            kv_scales=self._kv_scales)

    def _forward(self, size: int) -> torch.Tensor:
        # Async scheduling: a row's input id is the token the previous step sampled for it, fed on the device.
        rows = self._ints[4, :size]  # [size] int64
        input_ids = torch.where(rows >= 0, self._fed.gather(0, rows.clamp(min=0)), self._ints[0, :size])
        with self._lora.reading(self._inputs.buffers["lora"][:size]) if self._lora is not None else nullcontext():
            hidden = self.model(input_ids, self._context(size))  # [size, H]
        return self._logits.write(size, lambda out: self.model.compute_logits(hidden, out=out))  # [size, V]

    @torch.inference_mode()
    def capture(self, pool=None) -> float:
        """Captures every size (largest first, so the smaller ones reuse its memory) into `pool` (a graph
        pool handle shared with other graphs that never run at the same time; default: a new one); returns
        seconds. The padding rows used while capturing write nothing (slot -1) and read nothing (length 0)."""
        start = time.perf_counter()
        self._ints.zero_()
        self._ints[2].fill_(1)
        self._ints[3].fill_(-1)
        self._ints[4].fill_(-1)
        self._tables.zero_()
        self._seq_lens.zero_()
        if self._lora is not None:
            self._inputs.buffers["lora"].fill_(-1)
        capture_sizes_into(self.sizes, self._forward, pool, self._graphs, self._views)
        return time.perf_counter() - start

    def release(self) -> None:
        """Destroys the captured graphs. NCCL cannot tear down a communicator that a live graph captured a
        collective of (its destroy waits for the graph: pytorch#115388), so a tensor-parallel rank releases
        its graphs before it leaves its process groups."""
        release_graphs(self._graphs, self._seq_lens.device)

    def fits(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.max_batch_size

    def run(self, batch: DecodeBatch, fed_tokens: torch.Tensor | None = None,
            lora_rows: Sequence[int] | None = None) -> torch.Tensor:
        """Replays the graph for `batch`; returns its logits [len(batch), V] float32, valid until the next run.
        `fed_tokens`: [B] int64 on the device, the previous step's sampled tokens that `batch.feed_rows` index;
        `lora_rows`: each row's adapter slot (`LoRASlots.place`; None: no row has one)."""
        n = len(batch)
        size = next(s for s in self.sizes if s >= n)
        stage = self._inputs.stage()
        ints, seq_lens, tables = (stage[k].numpy() for k in ("ints", "seq_lens", "tables"))
        ints[0, :n] = batch.input_ids
        ints[1, :n] = batch.positions
        ints[2, :n] = batch.rope_lengths
        ints[3, :n] = batch.slots
        ints[4, :n] = batch.feed_rows if batch.feed_rows is not None else -1
        ints[:, n:size] = _PADDING_ROW
        seq_lens[:n] = batch.positions
        seq_lens[:n] += 1
        seq_lens[n:size] = 0
        if self._lora is not None:
            lora = stage["lora"].numpy()
            lora[:n] = -1 if lora_rows is None else lora_rows
            lora[n:size] = -1
        # Up to the batch's longest table; the stale block ids past a sequence's own blocks are never read
        # (attention stops at its length), nor those of the padding rows (length 0).
        self._mirror.gather(batch.block_tables, out=tables[:n])
        if batch.feed_rows is not None:
            self._fed[:len(fed_tokens)].copy_(fed_tokens)  # device to device, queued behind the previous step
        self._inputs.upload({"tables": size})
        self._graphs[size].replay()
        return self._views[size][:n]
