"""CUDA graphs of speculative decoding's verify steps: each request computes its last token and its drafts (a
chain of K, or a tree of N nodes), every position sampled.

Run eagerly, such a step launches a few hundred kernels from Python, and at small batch that host time, not
the GPU, sets the pace: on an H200 the bundled tiny model decoded 3,639 tok/s plain (captured decode graphs)
but 659 tok/s with n-gram drafts accepted 2.5 at a time.

A graph of size S runs S sequences of Q = `verify_tokens` token rows each: sequence i owns rows i*Q ..
i*Q + Q - 1. A request of n <= Q tokens (1 + its drafts; a decoding request without drafts, n = 1) fills its
first n rows; the rest are padding: they write no KV (slot -1), borrow the last real row's position and rope
length, and their outputs are dropped. The sequence's length counts them (seq_len = start + Q), which the
attention kernels read as "the queries are the sequence's last Q positions": a real row at position p still
attends to keys <= p only, so padding changes no real row. A tree's masks count keys back from the
sequence's last one (plugins/tree_mask.py), so they are shifted past the padding keys.

Outputs: the logits of every row, [S*Q, V] float32, and with EAGLE-3 the features of every row, [S*Q, F],
land in buffers allocated once (graph_inputs.OutputBuffer): every graph writes a prefix of the same buffer.
The real rows are gathered out of them after the replay. Only batches of up to VERIFY_MAX_TOKENS rows are
captured: speculation pays at small batch, where launches dominate, and the logits buffer grows with the rows.
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
from kiln.plugins.host_tensors import to_device
from kiln.plugins.tree_mask import TREE_SPAN
from kiln.runtime.core.scheduler import SchedulerOutput
from kiln.runtime.worker.block_table_mirror import BlockTableMirror
from kiln.runtime.worker.cuda_graphs import capture_sizes
from kiln.runtime.worker.graph_inputs import GraphInputs, OutputBuffer, capture_sizes_into, release_graphs
from kiln.runtime.worker.kv_cache import LayerCache, LayerScales
from kiln.runtime.worker.step_inputs import rope_lengths_of, slots_of
from kiln.runtime.worker.tree_rows import tree_rows

if TYPE_CHECKING:
    from kiln.runtime.worker.lora_slots import LoRASlots

VERIFY_MAX_TOKENS = 512  # rows of the largest captured verify step (8B: a 262 MB float32 logits buffer)


def verify_sizes(max_batch_size: int, max_num_tokens: int, tokens_per_seq: int) -> list[int]:
    """The batch sizes captured for verify steps of `tokens_per_seq` rows a sequence: `capture_sizes` up to
    what max_num_tokens and VERIFY_MAX_TOKENS allow (empty when not even one sequence fits)."""
    largest = min(max_batch_size, min(max_num_tokens, VERIFY_MAX_TOKENS) // tokens_per_seq)
    return capture_sizes(largest) if largest > 0 else []


def _shift_mask(mask: int, pad: int) -> int:
    """A tree mask (signed int64) for a sequence whose last `pad` keys are padding: its keys move `pad` further
    back from the end, and the padding keys are not seen."""
    bits = (mask << pad) & ((1 << TREE_SPAN) - 1)
    return bits - (1 << TREE_SPAN) if bits >= 1 << (TREE_SPAN - 1) else bits


@dataclass(frozen=True)
class VerifyBatch:
    """One verify step as host data, already laid out in rows of Q per sequence (padding included)."""

    input_ids: list[int]  # [S*Q]
    positions: list[int]  # [S*Q]
    rope_lengths: list[int]  # [S*Q]
    slots: list[int]  # [S*Q], -1 for padding rows
    tree_masks: list[int] | None  # [S*Q], None in a chain step
    seq_lens: list[int]  # [S]: start + Q
    block_tables: list[Sequence[int]]  # [S]
    real_rows: list[int]  # the rows of real tokens, in schedule order
    logits_offsets: tuple[int, ...]  # request i's sampled rows among the real ones (StepResult's)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def verify_batch(step: SchedulerOutput, block_size: int, model: CausalLM, prompt_logprob_targets: dict,
                 tokens_per_seq: int, tree: bool, require_drafts: bool = True) -> VerifyBatch | None:
    """The step as a VerifyBatch when a verify graph can run it: every request decoding (its n <= Q tokens all
    sampled: the last token and its drafts), no prompt logprobs, rope without per-length tables, and (with
    `require_drafts`; a plain decode step has cheaper graphs) at least one request with drafts; else None.
    `tree`: the graphs read tree masks."""
    q = tokens_per_seq
    # Checked first, without building rows: speculating engines run plain decode and prefill steps too.
    if require_drafts and not any(len(r.token_ids) > 1 for r in step.requests):
        return None
    ids, positions, ropes, slots, masks, lens, tables, real, offsets = [], [], [], [], [], [], [], [], [0]
    for i, r in enumerate(step.requests):
        n = len(r.token_ids)
        if n > q or r.num_sampled != n or r.request_id in prompt_logprob_targets:
            return None
        if r.draft_parents and not tree:
            return None
        start, pad = r.start_position, q - n
        rope_prompt = max(r.num_prompt_tokens, r.rope_min_length)
        if r.draft_parents:
            mine, tree_masks = tree_rows(r)
            masks.extend(_shift_mask(m, pad) for m in tree_masks)
            ropes.extend(max(p + 1, rope_prompt) for p in mine)
        else:
            mine = list(range(start, start + n))
            masks.extend([0] * n)
            ropes.extend(rope_lengths_of(start, start + n, rope_prompt))
        ids.extend(r.token_ids)
        positions.extend(mine)
        slots.extend(slots_of(r.block_ids, start, start + n, block_size))
        # Padding rows: the last real row's position (a valid rope index), no KV write.
        ids.extend([0] * pad)
        positions.extend([mine[-1]] * pad)
        ropes.extend([ropes[-1]] * pad)
        slots.extend([-1] * pad)
        masks.extend([0] * pad)
        lens.append(start + q)
        tables.append(r.block_ids)
        real.extend(range(i * q, i * q + n))
        offsets.append(offsets[-1] + n)
    if not ids or model.needs_per_length_rope(max(ropes)):
        return None
    return VerifyBatch(ids, positions, ropes, slots, masks if tree else None, lens, tables, real, tuple(offsets))


class VerifyGraphs:
    """Captured verify steps of `tokens_per_seq` rows a sequence for `verify_sizes(...)` batch sizes; `run`
    replays the one that fits. `tree`: the graphs read tree masks (tree drafts). `capture_layers`: EAGLE-3's
    feature layers, whose residual streams every run returns too (ForwardContext.capture_layers)."""

    def __init__(self, model: CausalLM, kv_caches: tuple[LayerCache, ...], *, tokens_per_seq: int,
                 max_batch_size: int, max_num_tokens: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, tree: bool = False, capture_layers: tuple[int, ...] = (),
                 kv_scales: tuple[LayerScales, ...] | None = None, lora: LoRASlots | None = None) -> None:
        self.model = model
        self.tokens_per_seq = q = tokens_per_seq
        self.tree = tree
        self.capture_layers = tuple(capture_layers)
        self.sizes = verify_sizes(max_batch_size, max_num_tokens, q)
        g = self.sizes[-1] if self.sizes else 0
        # A padding row's keys may lie past the sequence's last block (even past max_seq_len): the tables have
        # columns to spare, whose (stale or zero) block ids only padding rows read.
        mb = max_blocks_per_seq + -(-q // block_size)
        # ints: [4, G*Q] int64 rows = input_ids, positions, rope_lengths, slot_mapping; seq_lens: [G] int32;
        # tables: [G, MB] int32; tree: [G*Q] int64 masks; lora: [G*Q] int32 each row's adapter slot (-1: none).
        specs = {"ints": ((4, g * q), torch.int64), "seq_lens": ((g,), torch.int32), "tables": ((g, mb), torch.int32)}
        if tree:
            specs["tree"] = ((g * q,), torch.int64)
        self._lora = lora
        if lora is not None:
            specs["lora"] = ((g * q,), torch.int32)
        self._inputs = GraphInputs(specs, device)
        self._query_start_loc = torch.arange(0, (g + 1) * q, q, dtype=torch.int32, device=device)  # [G+1]
        self._mirror = BlockTableMirror(2 * g, mb)
        self._kv_caches = kv_caches
        self._kv_scales = kv_scales
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._views: dict[int, torch.Tensor] = {}
        self._logits = OutputBuffer(g * q)  # [G*Q, V] float32
        self._features = OutputBuffer(g * q)  # [G*Q, F] in the model's dtype, with capture_layers
        self.replays = 0  # graph runs (tests check that a step took this path)

    def fits(self, num_seqs: int) -> bool:
        return bool(self.sizes) and 0 < num_seqs <= self.sizes[-1]

    def _forward(self, size: int) -> torch.Tensor:
        b, t = self._inputs.buffers, size * self.tokens_per_seq
        ints = b["ints"]
        context = ForwardContext(
            positions=ints[1, :t], rope_lengths=ints[2, :t], slot_mapping=ints[3, :t], block_tables=b["tables"][:size],
            seq_lens=b["seq_lens"][:size], query_start_loc=self._query_start_loc[:size + 1],
            kv_caches=self._kv_caches, max_rope_length=0, kv_scales=self._kv_scales,
            capture_layers=self.capture_layers, captured={}, tree_mask=b["tree"][:t] if self.tree else None)
        with self._lora.reading(b["lora"][:t]) if self._lora is not None else nullcontext():
            hidden = self.model(ints[0, :t], context)  # [t, H]
        if self.capture_layers:
            parts = [context.captured[i] for i in self.capture_layers]  # each [t, H]
            self._features.write(t, lambda out: torch.cat(parts, dim=-1, out=out) if out is not None
                                 else torch.cat(parts, dim=-1))
        return self._logits.write(t, lambda out: self.model.compute_logits(hidden, out=out))  # [t, V]

    @torch.inference_mode()
    def capture(self, pool=None) -> float:
        """Captures every size, largest first, into `pool` (shared with graphs never run at the same time);
        returns seconds. While capturing every row is padding: nothing is written (slot -1) or attended
        (length 0)."""
        start = time.perf_counter()
        for buffer in self._inputs.buffers.values():
            buffer.zero_()
        ints = self._inputs.buffers["ints"]
        ints[2].fill_(1)
        ints[3].fill_(-1)
        if self._lora is not None:
            self._inputs.buffers["lora"].fill_(-1)
        capture_sizes_into(self.sizes, self._forward, pool, self._graphs, self._views)
        return time.perf_counter() - start

    def release(self) -> None:
        """Destroys the captured graphs (see DecodeGraphs.release)."""
        release_graphs(self._graphs, self._query_start_loc.device)

    def run(self, batch: VerifyBatch, lora_rows: Sequence[int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replays the graph for `batch`; returns the real rows' logits [R, V] float32 and, with capture_layers,
        features [R, F] (new tensors: the buffers are rewritten by the next run). `lora_rows`: each real token's
        adapter slot (`LoRASlots.place`; None: none)."""
        n, q = batch.num_seqs, self.tokens_per_seq
        size = next(s for s in self.sizes if s >= n)
        t, used = size * q, n * q
        stage = self._inputs.stage()
        ints, seq_lens = stage["ints"].numpy(), stage["seq_lens"].numpy()
        ints[0, :used] = batch.input_ids
        ints[1, :used] = batch.positions
        ints[2, :used] = batch.rope_lengths
        ints[3, :used] = batch.slots
        ints[:, used:t] = np.array([[0], [0], [1], [-1]], dtype=np.int64)
        seq_lens[:n] = batch.seq_lens
        seq_lens[n:size] = 0
        if self.tree:
            tree = stage["tree"].numpy()
            tree[:used] = batch.tree_masks
            tree[used:t] = 0
        if self._lora is not None:
            lora = stage["lora"].numpy()
            lora[:t] = -1
            if lora_rows is not None:
                lora[batch.real_rows] = lora_rows
        self._mirror.gather(batch.block_tables, out=stage["tables"].numpy()[:n])
        self._inputs.upload({"tables": size})
        graph = self._graphs.get(size)
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:  # never captured (the CPU): the same forward over the same buffers, eagerly; tests check the layout
            self._forward(size)
        rows = to_device(batch.real_rows, torch.int64, self._query_start_loc.device)  # [R]
        logits = self._logits.buffer.index_select(0, rows)  # [R, V]
        features = self._features.buffer.index_select(0, rows) if self.capture_layers else None  # [R, F]
        return logits, features
