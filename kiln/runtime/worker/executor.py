"""The executor seam: what the engine core calls to run the network, wherever the network lives.

The engine schedules, samples and detokenizes; an executor only turns a plain-data `StepInput` into
logits. `LocalExecutor` runs one rank in this process; `distributed.TPExecutor` is rank 0 of a
tensor-parallel engine, which sends each StepInput to the other ranks and returns the gathered logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kiln.checkpoints.lora_adapter import LoRAAdapter
from kiln.model_defs import CausalLM
from kiln.runtime.core.lora_request import LoRARequest
from kiln.runtime.core.scheduler import SchedulerOutput
from kiln.runtime.worker.engine_loader import RuntimeConfig
from kiln.runtime.worker.kv_host_tier import HostKVTier
from kiln.runtime.worker.memory import MemoryReport
from kiln.runtime.worker.model_runner import LoRALimits, ModelRunner, RunnerLimits
from kiln.runtime.worker.model_step import StepInput, StepResult


class Executor(Protocol):
    num_kv_blocks: int  # KV blocks each rank holds (the block manager manages this many)
    num_host_kv_blocks: int  # host KV tier slots each rank holds (kv_offloading_size; 0: no host tier)
    # This process's host KV tier when it holds the whole cache (one rank), else None: the disk tier reads and
    # writes slots through it.
    host_kv_tier: HostKVTier | None
    memory_report: MemoryReport  # where rank 0's device memory went at startup
    graph_capture_seconds: float
    fault: str | None  # why steps cannot run any more (a rank failed); None while they can
    # Whether execute takes a StepInput with a TokenFeed (async scheduling): the previous step's tokens stay on
    # this process's device, which the ranks of a tensor-parallel engine do not share.
    accepts_token_feed: bool

    def execute(self, step: StepInput) -> StepResult:
        """Runs one step on every rank; logits come back on rank 0's device."""
        ...

    def shutdown(self) -> None:
        """Releases the ranks (workers, process groups); the executor is unusable afterwards."""
        ...


def runner_limits(runtime: RuntimeConfig, tp_size: int = 1) -> RunnerLimits:
    """What a rank's ModelRunner sizes its memory and graphs for, from the runtime config (one of `tp_size`
    ranks: its share of the host KV tier)."""
    return RunnerLimits(max_batch_size=runtime.max_batch_size, max_num_tokens=runtime.max_num_tokens,
                        max_seq_len=runtime.max_seq_len, block_size=runtime.block_size,
                        num_kv_blocks=runtime.num_kv_blocks, kv_cache_memory_fraction=runtime.kv_cache_memory_fraction,
                        cuda_graphs=runtime.cuda_graphs,
                        lora=LoRALimits(runtime.max_loras, runtime.max_lora_rank, runtime.max_cpu_loras)
                        if runtime.enable_lora else None, host_kv_bytes=runtime.host_kv_bytes(tp_size),
                        verify_tokens=runtime.verify_tokens, verify_tree=runtime.verify_tree,
                        feature_layers=runtime.feature_layers)


class LocalExecutor:
    """One rank in this process: a ModelRunner over an already loaded network. `kv_cache_scales`: the
    engine's per-layer (k_scale, v_scale) for a quantized (FP8, INT8) KV cache, None for a float cache."""

    def __init__(self, model: CausalLM, runtime: RuntimeConfig,
                 kv_cache_scales: Sequence[tuple[float, float]] | None = None) -> None:
        self.runner = ModelRunner(model, device=runtime.device, kv_cache_dtype=runtime.cache_dtype,
                                  limits=runner_limits(runtime), kv_cache_scales=kv_cache_scales)
        # Fixed once the runner has started.
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.num_host_kv_blocks = self.runner.num_host_kv_blocks
        self.host_kv_tier = self.runner.host_tier
        self.memory_report = self.runner.memory_report
        self.graph_capture_seconds = self.runner.graph_capture_seconds
        self.fault = None
        self.accepts_token_feed = True
        # EAGLE-3: where each step's features go (capture_hidden); None: none are kept.
        self._hidden_sink: Callable[[SchedulerOutput, torch.Tensor], None] | None = None

    def execute(self, step: StepInput) -> StepResult:
        result = self.runner.execute(step)
        if self._hidden_sink is not None and result.aux_hidden is not None:
            self._hidden_sink(step.schedule, result.aux_hidden)
        return result

    def capture_hidden(self, layers: tuple[int, ...], sink: Callable[[SchedulerOutput, torch.Tensor], None]) -> None:
        """Hands every later step's residual streams entering `layers` (`StepResult.aux_hidden`, [T, 3H] for an
        EAGLE-3 head) to `sink` with the step's schedule, in this process, as the step is launched."""
        self.runner.capture_hidden(layers)
        self._hidden_sink = sink

    def add_lora(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Keeps the adapter `request` names in host memory: `adapter`, already read (`read_lora_adapter`, off the
        engine thread), or read here when None and not held; a ValueError says why it cannot be served. Only on
        an executor made with enable_lora."""
        if self.runner.lora is None:
            raise ValueError("a lora_request needs the engine started with enable_lora=True (--enable-lora)")
        self.runner.lora.register(request, adapter)

    def holds_lora(self, lora_int_id: int) -> bool:
        """Whether the adapter is in host memory (safe from any thread)."""
        return self.runner.lora is not None and self.runner.lora.holds(lora_int_id)

    def pin_lora(self, lora_int_id: int, pinned: bool) -> None:
        """A live request naming the (added) adapter arrives (True) or leaves (False): pinned adapters stay in
        host memory."""
        if pinned:
            self.runner.lora.pin(lora_int_id)
        else:
            self.runner.lora.unpin(lora_int_id)

    def lora_stats(self) -> dict[str, int]:
        """`LoRASlots.stats`: slot loads, disk reads, adapters in host memory and pinned."""
        return self.runner.lora.stats()

    def shutdown(self) -> None:
        pass
