"""How much memory the KV cache gets, and the startup report of where device memory went.

On CUDA the KV cache takes `kv_cache_memory_fraction` of the memory that is free once the weights are
loaded and a profiling step at the engine's limits has measured the peak activation memory; CUDA graphs
are captured afterwards, out of the share left over, and the report says what they took. On the CPU the
cache is sized for max_batch_size sequences of max_seq_len, within that fraction of available host memory
(the host runs other things too, so it never takes more than it can use).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kiln.engine_format import EngineError

GIB = 2**30


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per use on the runtime device (graph and activation bytes are 0 on the CPU)."""

    device: str
    total_bytes: int
    weights_bytes: int
    activation_bytes: int  # peak of the profiling step (max_num_tokens tokens, max_batch_size logits)
    kv_cache_bytes: int
    graph_bytes: int
    num_kv_blocks: int
    block_size: int
    max_seq_len: int
    kv_cache_memory_fraction: float
    kv_cache_dtype: str = ""  # the cache's element type, e.g. "bfloat16" or "float8_e4m3fn"
    kv_bytes_per_token: int = 0  # keys and values of one token over all layers (KVCache.bytes_per_token)
    tp_size: int = 1  # ranks of a tensor-parallel engine: the numbers are one rank's (each holds alike)
    dummy_weights_at_load: bool = False  # the weights are random, drawn at load (the engine has no weight files)
    host_tier_bytes: int = 0  # host memory of the KV cache's host tier (kv_offloading_size's share of a rank)
    host_tier_blocks: int = 0  # KV blocks the host tier holds

    @property
    def sequences_at_max_len(self) -> int:
        """How many sequences of max_seq_len tokens the cache holds at once."""
        return self.num_kv_blocks // -(-self.max_seq_len // self.block_size)

    def summary(self) -> str:
        where = self.device if self.tp_size == 1 else f"{self.device}, per rank of {self.tp_size}"
        drawn = " (dummy, drawn at load)" if self.dummy_weights_at_load else ""
        return (f"memory on {where}: weights {self.weights_bytes / GIB:.2f} GiB{drawn}, activations "
                f"{self.activation_bytes / GIB:.2f} GiB, KV cache {self.kv_cache_bytes / GIB:.2f} GiB "
                f"({self.kv_cache_dtype or 'unknown dtype'}, {self.kv_bytes_per_token} bytes per token; "
                f"{self.num_kv_blocks} blocks of {self.block_size} tokens = "
                f"{self.num_kv_blocks * self.block_size} "
                f"tokens, {self.sequences_at_max_len} sequences of max_seq_len {self.max_seq_len}; "
                f"kv_cache_memory_fraction {self.kv_cache_memory_fraction}), CUDA graphs "
                f"{self.graph_bytes / GIB:.2f} GiB, of {self.total_bytes / GIB:.2f} GiB{self._host_tier()}")

    def _host_tier(self) -> str:
        if self.host_tier_bytes <= 0:
            return ""
        return (f"; host KV tier {self.host_tier_bytes / GIB:.2f} GiB ({self.host_tier_blocks} blocks = "
                f"{self.host_tier_blocks * self.block_size} tokens)")


def tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def host_available_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cpu_kv_blocks(bytes_per_block: int, fraction: float, max_batch_size: int, max_seq_len: int,
                  block_size: int) -> int:
    wanted = max_batch_size * -(-max_seq_len // block_size)
    affordable = int(host_available_bytes() * fraction) // bytes_per_block
    return max(1, min(wanted, affordable))


def cuda_kv_blocks(device: torch.device, bytes_per_block: int, fraction: float, activation_bytes: int,
                   weights_bytes: int, block_size: int, max_seq_len: int) -> int:
    """Blocks that fit in `fraction` of the free memory minus the profiled activation peak; an error that
    says which number to lower when not even one sequence of max_seq_len fits."""
    free, _ = torch.cuda.mem_get_info(device)
    budget = int((free - activation_bytes) * fraction)
    blocks = max(0, budget) // bytes_per_block
    needed = -(-max_seq_len // block_size)
    if blocks < needed:
        raise EngineError(
            f"out of GPU memory: after the weights ({weights_bytes / GIB:.2f} GiB) and the activations of one "
            f"step ({activation_bytes / GIB:.2f} GiB), {free / GIB:.2f} GiB is free and "
            f"kv_cache_memory_fraction {fraction} of it holds {blocks} KV blocks, fewer than the {needed} that "
            f"one sequence of max_seq_len {max_seq_len} needs: raise --kv-cache-memory-fraction, lower "
            f"--max-num-tokens (activations), or rebuild with a smaller --max-seq-len")
    return blocks


def plan_kv_blocks(device: torch.device, bytes_per_block: int, requested: int | None, *, fraction: float,
                   activation_bytes: int, weights_bytes: int, max_batch_size: int, max_seq_len: int,
                   block_size: int) -> int:
    """How many KV blocks to allocate: `requested` when given, else what the memory on `device` allows."""
    if requested is not None:
        return requested
    if device.type == "cuda":
        return cuda_kv_blocks(device, bytes_per_block, fraction, activation_bytes, weights_bytes, block_size,
                              max_seq_len)
    return cpu_kv_blocks(bytes_per_block, fraction, max_batch_size, max_seq_len, block_size)


def out_of_memory(stage: str, fraction: float) -> EngineError:
    """The error for an out-of-memory failure at startup, naming the numbers that decide it."""
    return EngineError(
        f"out of GPU memory while {stage}: lower --kv-cache-memory-fraction (now {fraction}; the KV cache takes "
        f"that share of the memory left after weights and activations), or --max-batch-size (CUDA graphs and "
        f"logits), or --max-num-tokens (activations)")
