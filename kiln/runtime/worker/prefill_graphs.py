"""CUDA graphs of one sequence's prefill: a step that computes 2..N tokens of a single request.

An eager 8B step launches ~340 kernels, and for a short prompt their launches (Python, the kernels'
argument handling) take longer than the GPU needs to run them: a 128-token prefill was 21 ms of host
time for 7 ms of kernels. That step is what a lone request waits for before its first token, so the
common single-request shapes are captured: token counts padded up to a captured size (16, 32, ... 512).

The padding tokens write nothing (slot -1) and belong to no sequence (query_start_loc ends at the real
count), so attention skips them; their rows of the other operators are computed and dropped. Any start
position works (a later chunk of a long prompt, a prefix-cache hit): the sequence's length and block table
are inputs. Steps of several requests, with prompt logprobs or with per-length rope run eagerly. With LoRA
adapters the tokens' adapter slots are an input too (as in cuda_graphs.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kiln.model_defs import CausalLM
from kiln.model_defs.layers import ForwardContext
from kiln.runtime.core.scheduler import SchedulerOutput
from kiln.runtime.worker.block_table_mirror import BlockTableMirror
from kiln.runtime.worker.graph_inputs import GraphInputs, OutputBuffer, capture_sizes_into, release_graphs
from kiln.runtime.worker.kv_cache import LayerCache, LayerScales
from kiln.runtime.worker.model_step import TokenFeed
from kiln.runtime.worker.step_inputs import rope_lengths_of, slots_of

if TYPE_CHECKING:
    from kiln.runtime.worker.lora_slots import LoRASlots

# Powers of two from 16: padding at most doubles a step's tokens, and a 512-token step's kernels already take
# longer than their launches.
PREFILL_SIZES = (16, 32, 64, 128, 256, 512)


def prefill_sizes(max_num_tokens: int) -> list[int]:
    """The captured token counts an engine with this `max_num_tokens` can schedule."""
    return [s for s in PREFILL_SIZES if s <= max_num_tokens] or [PREFILL_SIZES[0]]


@dataclass(frozen=True)
class PrefillBatch:
    """One request's step as host data: its tokens at positions start.., the last `num_sampled` (0 or 1)
    of them sampled."""

    input_ids: tuple[int, ...]
    start: int
    num_prompt_tokens: int  # what rope counts positions from: the prompt length, or a larger rope_min_length
    block_table: tuple[int, ...] | list[int]
    num_sampled: int

    def __len__(self) -> int:
        return len(self.input_ids)


def prefill_batch(step: SchedulerOutput, model: CausalLM, prompt_logprob_targets: dict,
                  feed: TokenFeed | None) -> PrefillBatch | None:
    """The step as a PrefillBatch when a captured prefill graph can run it: one request of at least two
    tokens (one is a decode step), at most one sampled position, no prompt logprobs, no fed token, and rope
    that needs no per-length tables; else None."""
    if len(step.requests) != 1:
        return None
    r = step.requests[0]
    n = len(r.token_ids)
    if n < 2 or r.num_sampled > 1 or r.request_id in prompt_logprob_targets:
        return None
    if feed is not None and feed.rows[0] >= 0:
        return None
    rope_prompt = max(r.num_prompt_tokens, r.rope_min_length)  # the length rope_lengths_of counts from
    if model.needs_per_length_rope(max(r.start_position + n, rope_prompt)):
        return None
    return PrefillBatch(r.token_ids, r.start_position, rope_prompt, r.block_ids, r.num_sampled)


class PrefillGraphs:
    """Captured single-sequence steps for `prefill_sizes(max_num_tokens)`; `run` replays the one that fits."""

    def __init__(self, model: CausalLM, kv_caches: tuple[LayerCache, ...], *, max_num_tokens: int,
                 max_blocks_per_seq: int, block_size: int, device: torch.device,
                 kv_scales: tuple[LayerScales, ...] | None = None, lora: LoRASlots | None = None) -> None:
        self.model = model
        self.sizes = prefill_sizes(max_num_tokens)
        self.block_size = block_size
        t = self.sizes[-1]
        # ints: [4, T] int64 rows = input_ids, positions, rope_lengths, slot_mapping; lens: [3] int32 =
        # seq_lens[0], query_start_loc[0:2]; sample: [1] int64, the row whose logits are sampled;
        # table: [1, MB] int32; with LoRA, lora: [T] int32 each token's adapter slot (-1: none).
        specs = {"ints": ((4, t), torch.int64), "lens": ((3,), torch.int32), "sample": ((1,), torch.int64),
                 "table": ((1, max_blocks_per_seq), torch.int32)}
        self._lora = lora
        if lora is not None:
            specs["lora"] = ((t,), torch.int32)
        self._inputs = GraphInputs(specs, device)
        self._mirror = BlockTableMirror(4, max_blocks_per_seq)
        self._kv_caches = kv_caches
        self._kv_scales = kv_scales
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits = OutputBuffer(1)  # [1, V] float32, written by every graph
        self._views: dict[int, torch.Tensor] = {}

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def _forward(self, size: int) -> torch.Tensor:
        b = self._inputs.buffers
        ints, lens = b["ints"], b["lens"]
        context = ForwardContext(
            positions=ints[1, :size], rope_lengths=ints[2, :size], slot_mapping=ints[3, :size],
            block_tables=b["table"], seq_lens=lens[0:1], query_start_loc=lens[1:3], kv_caches=self._kv_caches,
            max_rope_length=0, kv_scales=self._kv_scales)
        with self._lora.reading(b["lora"][:size]) if self._lora is not None else nullcontext():
            hidden = self.model(ints[0, :size], context)  # [size, H]
        sampled = hidden.index_select(0, b["sample"])  # [1, H]
        return self._logits.write(1, lambda out: self.model.compute_logits(sampled, out=out))  # [1, V] float32

    @torch.inference_mode()
    def capture(self, pool=None) -> float:
        """Captures every size, largest first, into `pool` (shared with graphs never run at the same time);
        returns seconds. While capturing, the sequence has no tokens: nothing is written or attended."""
        start = time.perf_counter()
        for buffer in self._inputs.buffers.values():
            buffer.zero_()
        self._inputs.buffers["ints"][3].fill_(-1)
        if self._lora is not None:
            self._inputs.buffers["lora"].fill_(-1)
        capture_sizes_into(self.sizes, self._forward, pool, self._graphs, self._views)
        return time.perf_counter() - start

    def release(self) -> None:
        """Destroys the captured graphs (see DecodeGraphs.release)."""
        release_graphs(self._graphs, self._inputs.buffers["lens"].device)

    def run(self, batch: PrefillBatch, lora_rows: Sequence[int] | None = None) -> torch.Tensor:
        """Replays the graph for `batch`; returns the logits of its sampled position, [num_sampled, V] float32,
        valid until the next run. `lora_rows`: each token's adapter slot (`LoRASlots.place`; None: none)."""
        n = len(batch)
        size = next(s for s in self.sizes if s >= n)
        stage = self._inputs.stage()
        ints, lens = stage["ints"].numpy(), stage["lens"].numpy()
        start, stop = batch.start, batch.start + n
        ints[0, :n] = batch.input_ids
        ints[1, :n] = range(start, stop)
        ints[2, :n] = rope_lengths_of(start, stop, batch.num_prompt_tokens)
        ints[3, :n] = slots_of(batch.block_table, start, stop, self.block_size)
        ints[:, n:size] = ((0,), (0,), (1,), (-1,))  # padding: position 0, writes nothing
        lens[:] = (stop, 0, n)  # seq_lens[0]; query_start_loc = [0, n]: the padding is no sequence's
        stage["sample"][0] = n - 1
        if self._lora is not None:
            lora = stage["lora"].numpy()
            lora[:n] = -1 if lora_rows is None else lora_rows
            lora[n:size] = -1
        self._mirror.gather([batch.block_table], out=stage["table"].numpy())
        self._inputs.upload()
        self._graphs[size].replay()
        return self._views[size][:batch.num_sampled]
