"""The model runner: owns the device tensors (weights, KV cache, graph buffers) and turns one SchedulerOutput
into logits.

Tokens of all scheduled requests are packed into one flat batch (no padding); attention finds each
request's keys through its block table. Decode-only steps on CUDA replay a captured CUDA graph instead.
At startup on CUDA it measures the activation peak of one step at the engine's limits, sizes the KV cache
from what is left (runtime/memory.py), then captures the graphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from kiln.model_defs import ModelConfig
from kiln.model_defs.layers import ForwardContext

from . import memory
from .cuda_graphs import DecodeBatch, DecodeGraphs
from .host_tensors import to_device
from .sampler import Sampler, SamplingRow
from .sampling_params import SamplingParams
from .scheduler import SchedulerOutput

logger = logging.getLogger("kiln.runtime")


@dataclass(frozen=True)
class StepResult:
    logits: torch.Tensor  # [R, V] float32: one row per request with `sample` set, in schedule order
    sample_ids: tuple[str, ...]  # request id of each logits row
    # request id -> (first prompt position p, logprobs of prompt[p+1], prompt[p+2], ...) for requests that
    # asked for prompt logprobs and computed prompt tokens this step.
    prompt_logprobs: dict[str, tuple[int, list[float]]]


@dataclass(frozen=True)
class RunnerLimits:
    """The runtime limits the runner sizes its memory for."""

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    block_size: int
    num_kv_blocks: int | None  # None: as many as kv_cache_memory_fraction allows
    kv_cache_memory_fraction: float = 0.9
    cuda_graphs: bool = True


class ModelRunner:
    def __init__(self, model: nn.Module, config: ModelConfig, *, device: torch.device, dtype: torch.dtype,
                 limits: RunnerLimits) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.limits = limits
        self.block_size = limits.block_size
        model.setup_rotary(limits.max_seq_len, device)
        weights = memory.tensor_bytes(model)
        per_block = self.kv_bytes_per_block(config, limits.block_size, dtype)
        fraction = limits.kv_cache_memory_fraction
        activation = 0
        if device.type == "cuda":
            activation = self._profile_activation_bytes(dtype)
        if limits.num_kv_blocks is not None:
            self.num_kv_blocks = limits.num_kv_blocks
        elif device.type == "cuda":
            self.num_kv_blocks = memory.cuda_kv_blocks(device, per_block, fraction, activation, weights,
                                                       limits.block_size, limits.max_seq_len)
        else:
            self.num_kv_blocks = memory.cpu_kv_blocks(per_block, fraction, limits.max_batch_size,
                                                      limits.max_seq_len, limits.block_size)
        try:
            # Allocated once for the engine's lifetime: captured graphs read these addresses.
            # kv_cache: [layers, 2, num_blocks, block_size, Hk, D]
            self.kv_cache = torch.zeros(config.num_layers, 2, self.num_kv_blocks, limits.block_size,
                                        config.num_kv_heads, config.head_dim, dtype=dtype, device=device)
        except torch.OutOfMemoryError:
            raise memory.out_of_memory(f"allocating {self.num_kv_blocks} KV blocks", fraction) from None
        self.kv_caches = tuple((self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(config.num_layers))
        self.graphs: DecodeGraphs | None = None
        self.graph_capture_seconds = 0.0
        graph_bytes = 0
        if device.type == "cuda" and limits.cuda_graphs:
            graph_bytes = self._capture_graphs(fraction)
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
        self.memory_report = memory.MemoryReport(
            device=str(device), total_bytes=total, weights_bytes=weights, activation_bytes=activation,
            kv_cache_bytes=self.kv_cache.numel() * self.kv_cache.element_size(), graph_bytes=graph_bytes,
            num_kv_blocks=self.num_kv_blocks, block_size=limits.block_size, max_seq_len=limits.max_seq_len,
            kv_cache_memory_fraction=fraction)
        logger.info("%s", self.memory_report.summary())

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element

    # ---- startup -------------------------------------------------------------------------------
    @torch.inference_mode()
    def _profile_activation_bytes(self, dtype: torch.dtype) -> int:
        """Peak memory of one step at the limits: max_num_tokens tokens through the network, logits and a
        top-p sampling pass for max_batch_size rows. Runs on a throwaway cache just big enough."""
        lim, c = self.limits, self.config
        tokens = lim.max_num_tokens
        seq_len = min(lim.max_seq_len, tokens)
        lengths = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
        blocks_per_seq = -(-seq_len // lim.block_size)
        torch.cuda.synchronize(self.device)
        try:
            cache = torch.zeros(c.num_layers, 2, blocks_per_seq * len(lengths), lim.block_size, c.num_kv_heads,
                                c.head_dim, dtype=dtype, device=self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            ctx = self._context_from_lists(
                positions=[p for n in lengths for p in range(n)], rope_lengths=[seq_len] * tokens,
                slots=[s * blocks_per_seq * lim.block_size + p for s, n in enumerate(lengths) for p in range(n)],
                tables=[list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)) for s in range(len(lengths))],
                seq_lens=lengths, query_lens=lengths, kv_caches=tuple((cache[i, 0], cache[i, 1]) for i in range(c.num_layers)))
            hidden = self.model(torch.zeros(tokens, dtype=torch.int64, device=self.device), ctx)
            rows = torch.arange(lim.max_batch_size, device=self.device) % tokens
            logits = self.model.compute_logits(hidden[rows])
            params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=True, top_logprobs=5)
            Sampler()(logits, [SamplingRow(params, [0], [])] * lim.max_batch_size)
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - base
        except torch.OutOfMemoryError:
            raise memory.out_of_memory(f"profiling a step of {tokens} tokens", self.limits.kv_cache_memory_fraction
                                       ) from None
        finally:
            cache = hidden = logits = None
            torch.cuda.empty_cache()
        return peak

    def _capture_graphs(self, fraction: float) -> int:
        free_before, _ = torch.cuda.mem_get_info(self.device)
        max_blocks = -(-self.limits.max_seq_len // self.block_size)
        try:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, max_batch_size=self.limits.max_batch_size,
                                       max_blocks_per_seq=max_blocks, device=self.device)
            self.graph_capture_seconds = self.graphs.capture()
        except torch.OutOfMemoryError:
            raise memory.out_of_memory("capturing CUDA graphs", fraction) from None
        free_after, _ = torch.cuda.mem_get_info(self.device)
        logger.info("captured CUDA graphs for decode batch sizes %s in %.2fs", self.graphs.sizes,
                    self.graph_capture_seconds)
        return max(0, free_before - free_after)

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, prompts_for_logprobs: dict[str, list[int]] | None = None) -> StepResult:
        """Runs one step. `prompts_for_logprobs` maps the requests that want prompt logprobs to their prompt
        token ids (the targets that this step's positions predict)."""
        prompts_for_logprobs = prompts_for_logprobs or {}
        batch = self._decode_batch(step, prompts_for_logprobs)
        if batch is not None:
            logits = self.graphs.run(batch)  # [n, V]
            return StepResult(logits, tuple(r.request_id for r in step.requests), {})
        ctx, input_ids, sample_rows, sample_ids = self._prepare(step)
        hidden = self.model(input_ids, ctx)  # [T, H]
        logits = self.model.compute_logits(hidden[sample_rows])  # [R, V]
        prompt_logprobs = self._prompt_logprobs(step, hidden, prompts_for_logprobs) if prompts_for_logprobs else {}
        return StepResult(logits, sample_ids, prompt_logprobs)

    def _decode_batch(self, step: SchedulerOutput, prompts_for_logprobs: dict) -> DecodeBatch | None:
        """The step as a DecodeBatch when a captured graph can run it: one sampled token per request, no
        prompt logprobs, and rope tables that need no per-length work."""
        if self.graphs is None or not self.graphs.fits(len(step.requests)):
            return None
        bs = self.block_size
        ids, positions, rope_lengths, slots, tables = [], [], [], [], []
        for r in step.requests:
            if len(r.token_ids) != 1 or not r.sample or r.request_id in prompts_for_logprobs:
                return None
            p = r.start_position
            ids.append(r.token_ids[0])
            positions.append(p)
            rope_lengths.append(max(p + 1, r.num_prompt_tokens))
            slots.append(r.block_ids[p // bs] * bs + p % bs)
            tables.append(r.block_ids)
        if self.model.rotary.needs_per_length_tables(max(rope_lengths)):
            return None
        return DecodeBatch(ids, positions, rope_lengths, slots, tables)

    def _context_from_lists(self, *, positions: list[int], rope_lengths: list[int], slots: list[int],
                            tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
                            kv_caches: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> ForwardContext:
        width = max(len(t) for t in tables)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return ForwardContext(
            positions=to_device(positions, torch.int64, self.device),
            rope_lengths=to_device(rope_lengths, torch.int64, self.device),
            slot_mapping=to_device(slots, torch.int64, self.device),
            block_tables=to_device([list(t) + [0] * (width - len(t)) for t in tables], torch.int32, self.device),
            seq_lens=to_device(seq_lens, torch.int32, self.device),
            query_start_loc=to_device(starts, torch.int32, self.device),
            kv_caches=kv_caches,
            max_rope_length=max(rope_lengths),
        )

    def _prepare(self, step: SchedulerOutput) -> tuple[ForwardContext, torch.Tensor, torch.Tensor, tuple[str, ...]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        rope_lengths: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        end = 0
        for r in step.requests:
            n = len(r.token_ids)
            span = range(r.start_position, r.start_position + n)
            input_ids.extend(r.token_ids)
            positions.extend(span)
            rope_lengths.extend(max(p + 1, r.num_prompt_tokens) for p in span)
            slots.extend(r.block_ids[p // bs] * bs + p % bs for p in span)
            end += n
            if r.sample:
                sample_rows.append(end - 1)
                sample_ids.append(r.request_id)
        ctx = self._context_from_lists(
            positions=positions, rope_lengths=rope_lengths, slots=slots,
            tables=[r.block_ids for r in step.requests],
            seq_lens=[r.start_position + len(r.token_ids) for r in step.requests],
            query_lens=[len(r.token_ids) for r in step.requests], kv_caches=self.kv_caches)
        ids = to_device(input_ids, torch.int64, self.device)
        return ctx, ids, to_device(sample_rows, torch.int64, self.device), tuple(sample_ids)

    def _prompt_logprobs(self, step: SchedulerOutput, hidden: torch.Tensor,
                         prompts: dict[str, list[int]]) -> dict[str, tuple[int, list[float]]]:
        # Position p's logits predict token p+1; only prompt tokens followed by a prompt token count.
        result: dict[str, tuple[int, list[float]]] = {}
        offset = 0
        for r in step.requests:
            n = len(r.token_ids)
            first, last = r.start_position, min(r.start_position + n, r.num_prompt_tokens - 1)
            if r.request_id in prompts and last > first:
                rows = hidden[offset:offset + (last - first)]
                logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)  # [last-first, V]
                targets = prompts[r.request_id][first + 1:last + 1]
                picked = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])
                result[r.request_id] = (first, picked.squeeze(1).tolist())
            offset += n
        return result
