"""The model runner: owns the device tensors (weights, KV cache, graph buffers) and turns one StepInput into
logits.

Its pieces live in their own files: memory planning (memory.py, memory_profile.py), the KV cache
(kv_cache.py), input packing (step_inputs.py), decode and prefill CUDA graphs (cuda_graphs.py,
prefill_graphs.py) and prompt logprobs
(prompt_logprobs.py). At startup on CUDA it measures the activation peak of one step at the engine's
limits, sizes the KV cache from what is left, then captures the graphs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kiln.engine_format import Mapping
from kiln.model_defs import CausalLM
from kiln.plugins._triton import USE_TRITON
from kiln.runtime.sampling.prompt_logprobs import prompt_logprobs
from kiln.runtime.worker import memory
from kiln.runtime.worker.cuda_graphs import DecodeGraphs, decode_batch
from kiln.runtime.worker.kv_cache import KVCache, rank_cache_config
from kiln.runtime.worker.kv_host_tier import HostKVTier, host_tier_for
from kiln.runtime.worker.lora_slots import LoRASlots
from kiln.runtime.worker.memory_profile import profile_activation_bytes
from kiln.runtime.worker.model_step import StepInput, StepResult
from kiln.runtime.worker.prefill_graphs import PrefillGraphs, prefill_batch
from kiln.runtime.worker.step_inputs import feed_tokens, pack_step
from kiln.runtime.worker.verify_graphs import VerifyGraphs, verify_batch

logger = logging.getLogger("kiln.runtime")


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
    lora: LoRALimits | None = None  # None: no LoRA adapters
    host_kv_bytes: int = 0  # this rank's host KV tier (kv_offloading_size's share); 0: none
    # Speculative decoding: verify steps of up to this many tokens a request run in CUDA graphs
    # (verify_graphs.py; 0: none), as trees, keeping these layers' features (EAGLE-3).
    verify_tokens: int = 0
    verify_tree: bool = False
    feature_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoRALimits:
    """The LoRA slots the runner holds (`lora_slots.LoRASlots`)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


class ModelRunner:
    """`kv_cache_scales`: per layer (k_scale, v_scale) of a quantized (FP8, INT8) `kv_cache_dtype`
    (engine.json `kv_cache_scales`), None for a float cache; every step's ForwardContext carries them as
    device tensors.

    On a tensor-parallel rank (`mapping`), the cache holds this rank's KV heads, and `agree_num_blocks`
    turns the blocks this rank's memory holds into the number every rank allocates (the minimum); every
    rank must construct its runner and execute the same steps in the same order (their collectives meet)."""

    def __init__(self, model: CausalLM, *, device: torch.device, kv_cache_dtype: torch.dtype,
                 limits: RunnerLimits, kv_cache_scales: Sequence[tuple[float, float]] | None = None,
                 mapping: Mapping | None = None, agree_num_blocks: Callable[[int], int] | None = None) -> None:
        self.model = model
        self.device = device
        self.limits = limits
        self.block_size = limits.block_size
        model.setup_rotary(limits.max_seq_len, device)
        cache_config = rank_cache_config(model.config, mapping)
        weights = memory.tensor_bytes(model)
        # The LoRA slots before the KV cache is sized: on CUDA it takes a share of what is free after them.
        self.lora: LoRASlots | None = None
        if limits.lora is not None:
            self.lora = LoRASlots(model, model.config, max_loras=limits.lora.max_loras,
                                  max_lora_rank=limits.lora.max_lora_rank, max_cpu_loras=limits.lora.max_cpu_loras,
                                  device=device, dtype=next(model.parameters()).dtype, mapping=mapping)
        fraction = limits.kv_cache_memory_fraction
        activation = 0
        if device.type == "cuda":
            activation = profile_activation_bytes(
                model, max_num_tokens=limits.max_num_tokens, max_batch_size=limits.max_batch_size,
                max_seq_len=limits.max_seq_len, block_size=limits.block_size, kv_dtype=kv_cache_dtype,
                device=device, fraction=fraction, kv_scales=kv_cache_scales, cache_config=cache_config)
        # Ranks on one host share its memory: on the CPU each takes its share of the fraction.
        host_share = 1 if device.type == "cuda" or mapping is None else mapping.tp_size
        num_blocks = memory.plan_kv_blocks(
            device, KVCache.bytes_per_block(cache_config, limits.block_size, kv_cache_dtype), limits.num_kv_blocks,
            fraction=fraction / host_share, activation_bytes=activation, weights_bytes=weights,
            max_batch_size=limits.max_batch_size, max_seq_len=limits.max_seq_len, block_size=limits.block_size)
        if agree_num_blocks is not None:
            num_blocks = agree_num_blocks(num_blocks)
        try:
            self.kv_cache = KVCache(cache_config, num_blocks, limits.block_size, kv_cache_dtype, device,
                                    kv_cache_scales)
        except torch.OutOfMemoryError:
            raise memory.out_of_memory(f"allocating {num_blocks} KV blocks", fraction) from None
        self.num_kv_blocks = num_blocks
        # Before the graphs: its device staging buffers come out of the memory they would take.
        self.host_tier: HostKVTier | None = host_tier_for(self.kv_cache, limits.host_kv_bytes)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        self.graph_capture_seconds = 0.0
        # EAGLE-3's feature layers (capture_hidden); (): none. Every rank of a tensor-parallel engine starts with
        # the same ones, so that all take the same path through a step (graph or eager) and their collectives meet.
        self.capture_layers: tuple[int, ...] = limits.feature_layers
        graph_bytes = 0
        if device.type == "cuda" and limits.cuda_graphs and self.lora is not None and not USE_TRITON:
            # lora_add's reference reads the slots on the host: it cannot be captured.
            logger.info("enable_lora without Triton kernels: CUDA graphs are not captured (steps run eagerly)")
        elif device.type == "cuda" and limits.cuda_graphs:
            graph_bytes = self._capture_graphs(fraction)
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
        self.memory_report = memory.MemoryReport(
            device=str(device), total_bytes=total, weights_bytes=weights, activation_bytes=activation,
            kv_cache_bytes=self.kv_cache.nbytes, graph_bytes=graph_bytes, num_kv_blocks=num_blocks,
            block_size=limits.block_size, max_seq_len=limits.max_seq_len, kv_cache_memory_fraction=fraction,
            kv_cache_dtype=str(kv_cache_dtype).removeprefix("torch."),
            kv_bytes_per_token=KVCache.bytes_per_token(cache_config, kv_cache_dtype),
            tp_size=1 if mapping is None else mapping.tp_size,
            host_tier_bytes=self.host_tier.nbytes if self.host_tier is not None else 0,
            host_tier_blocks=self.num_host_kv_blocks)
        logger.info("%s", self.memory_report.summary())

    @property
    def num_host_kv_blocks(self) -> int:
        """Slots of the host KV tier (0: none)."""
        return self.host_tier.num_slots if self.host_tier is not None else 0

    def _capture_graphs(self, fraction: float) -> int:
        free_before, _ = torch.cuda.mem_get_info(self.device)
        max_blocks = -(-self.limits.max_seq_len // self.block_size)
        try:
            self.graphs = DecodeGraphs(self.model, self.kv_cache.layers, max_batch_size=self.limits.max_batch_size,
                                       max_blocks_per_seq=max_blocks, device=self.device,
                                       kv_scales=self.kv_cache.scales, lora=self.lora)
            self.prefill_graphs = PrefillGraphs(self.model, self.kv_cache.layers,
                                                max_num_tokens=self.limits.max_num_tokens,
                                                max_blocks_per_seq=max_blocks, block_size=self.block_size,
                                                device=self.device, kv_scales=self.kv_cache.scales, lora=self.lora)
            # One memory pool: no two graphs run at once. Prefill first: its largest size needs the most.
            pool = torch.cuda.graph_pool_handle()
            prefill_seconds = self.prefill_graphs.capture(pool)
            decode_seconds = self.graphs.capture(pool)
            verify_seconds = self._capture_verify_graphs(pool, max_blocks)
            self.graph_capture_seconds = prefill_seconds + decode_seconds + verify_seconds
        except torch.OutOfMemoryError:
            raise memory.out_of_memory("capturing CUDA graphs", fraction) from None
        free_after, _ = torch.cuda.mem_get_info(self.device)
        logger.info("captured CUDA graphs for decode batch sizes %s in %.2fs and single-sequence prefill token "
                    "counts %s in %.2fs", self.graphs.sizes, decode_seconds, self.prefill_graphs.sizes,
                    prefill_seconds)
        if self.verify_graphs is not None:
            logger.info("captured CUDA graphs for speculative verify steps of %d tokens a request (%s), batch "
                        "sizes %s, in %.2fs", self.limits.verify_tokens, "trees" if self.limits.verify_tree
                        else "chains", self.verify_graphs.sizes, verify_seconds)
        return max(0, free_before - free_after)

    def _capture_verify_graphs(self, pool, max_blocks: int) -> float:
        """Speculative decoding's verify graphs (limits.verify_tokens > 0), into `pool`; returns seconds."""
        limits = self.limits
        if limits.verify_tokens < 2:
            return 0.0
        graphs = VerifyGraphs(self.model, self.kv_cache.layers, tokens_per_seq=limits.verify_tokens,
                              max_batch_size=limits.max_batch_size, max_num_tokens=limits.max_num_tokens,
                              max_blocks_per_seq=max_blocks, block_size=self.block_size, device=self.device,
                              tree=limits.verify_tree, capture_layers=limits.feature_layers,
                              kv_scales=self.kv_cache.scales, lora=self.lora)
        if not graphs.sizes:
            return 0.0
        self.verify_graphs = graphs
        return graphs.capture(pool)

    def capture_hidden(self, layers: tuple[int, ...]) -> None:
        """Has every later step return the residual streams entering these decoder layers (StepResult.aux_hidden;
        an EAGLE-3 head's features). Verify graphs captured with these layers (limits.feature_layers) keep
        them; other steps that keep them run eagerly."""
        bad = [i for i in layers if not 0 <= i <= self.model.config.num_layers]
        if bad:
            raise ValueError(f"feature layers {list(layers)}: {bad} outside [0, {self.model.config.num_layers}] "
                             f"(the target has {self.model.config.num_layers} layers)")
        self.capture_layers = tuple(layers)

    def release_graphs(self) -> None:
        """Destroys the CUDA graphs (decode steps run eagerly afterwards); a tensor-parallel rank does this
        before leaving its process groups."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.prefill_graphs is not None:
            self.prefill_graphs.release()
            self.prefill_graphs = None
        if self.verify_graphs is not None:
            self.verify_graphs.release()
            self.verify_graphs = None

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepResult:
        """Runs one step: a captured graph for a plain decode batch or a single sequence's prefill, else the
        packed batch eagerly."""
        schedule, targets, feed = step.schedule, step.prompt_logprob_targets, step.token_feed
        request_ids = tuple(r.request_id for r in schedule.requests)
        # The host tier's copies, before anything touches those blocks; every step (even without transfers) is
        # ordered after the previous step's offloads, which read blocks it may write.
        if self.host_tier is not None:
            self.host_tier.apply(schedule.kv_transfers)
        elif not schedule.kv_transfers.is_empty:
            raise ValueError("a step with KV transfers, but this runner has no host KV tier "
                             "(kv_offloading_size / --kv-offloading-size is 0)")
        if schedule.block_copies:  # beams' copy-on-write: before anything reads or writes those blocks
            self.kv_cache.copy_blocks(schedule.block_copies)
        capture = self.capture_layers
        verify = self.verify_graphs
        if (verify is not None and feed is None and capture in ((), verify.capture_layers)
                and verify.fits(len(schedule.requests))):
            batch = verify_batch(schedule, self.block_size, self.model, targets, verify.tokens_per_seq, verify.tree,
                                 require_drafts=not capture)
            if batch is not None:
                rows = self.lora.place(schedule) if self.lora is not None else None
                logits, aux = verify.run(batch, rows)  # [R, V], [R, F] or None
                return StepResult(logits, request_ids, batch.logits_offsets, {}, aux if capture else None)
        if not capture and self.graphs is not None and self.graphs.fits(len(schedule.requests)):
            batch = decode_batch(schedule, self.block_size, self.model, targets, feed)
            if batch is not None:
                rows = self.lora.place(schedule) if self.lora is not None else None
                logits = self.graphs.run(batch, feed.tokens if feed is not None else None, rows)  # [n, V]
                return StepResult(logits, request_ids, tuple(range(len(batch) + 1)))
        if not capture and self.prefill_graphs is not None:
            one = prefill_batch(schedule, self.model, targets, feed)
            if one is not None and self.prefill_graphs.fits(len(one)):
                rows = self.lora.place(schedule) if self.lora is not None else None
                logits = self.prefill_graphs.run(one, rows)  # [num_sampled, V]
                return StepResult(logits, request_ids, (0, one.num_sampled))
        packed = pack_step(schedule, self.block_size, self.kv_cache.layers, self.device, self.kv_cache.scales)
        if feed is not None:
            feed_tokens(packed.input_ids, schedule, feed)
        if self.lora is not None:
            self.lora.prepare(schedule)
        context = packed.context
        if capture:  # EAGLE-3's features: the decoder keeps these layers' inputs in context.captured
            context = dataclasses.replace(context, capture_layers=capture, captured={})
        try:
            hidden = self.model(packed.input_ids, context)  # [T, H]
        finally:
            if self.lora is not None:
                self.lora.finish()
        logits = self.model.compute_logits(hidden[packed.sample_rows])  # [R, V]
        logprobs = prompt_logprobs(schedule, hidden, targets, self.model.compute_logits) if targets else {}
        aux = None
        if capture:
            missing = [i for i in capture if i not in context.captured]
            if missing:
                raise RuntimeError(f"{type(self.model).__name__} kept no features of layers {missing}: its forward "
                                   f"does not capture hidden states (EAGLE-3 needs a DecoderForCausalLM)")
            aux = torch.cat([context.captured[i] for i in capture], dim=-1)  # [T, len(capture) * H]
        return StepResult(logits, request_ids, packed.logits_offsets, logprobs, aux)
