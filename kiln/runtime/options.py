"""`RuntimeOptions`: how an engine is run (device, lower limits, KV-cache size, CUDA graphs, speculation).

The one list of them: `LLM`, `AsyncLLM`, `create_engine`, `ServeConfig.runtime`, the Triton model and the
commands' flags (kiln/commands/runtime_args.py generates one per field from the metadata here) all take it.
Checks that need no engine live here; those against the engine's built limits are `engine_loader`'s.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.runtime.core.capacity import CAPACITY_POLICIES
from kiln.runtime.speculative.config import SpeculativeConfig, speculative_config_of

if TYPE_CHECKING:
    import torch

MAX_KV_BLOCKS = 2**31 - 1  # block ids are int32


def _option(default: Any, help: str, **cli: Any) -> Any:
    """A field whose metadata carries its command-line help (and, for a flag, its argparse `type`)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class RuntimeOptions:
    """Runtime options of one engine; None limits mean the engine's built ones (they may only be lowered).
    Validated at construction: a ValueError names the field."""

    device: str | torch.device | None = _option(
        None, "device to run on (default: the engine's target)", type=str)
    """Where the engine runs ("cpu", "cuda", "cuda:1"); None: the device type the engine was built for."""
    max_batch_size: int | None = _option(None, "lower the engine's max_batch_size", type=int)
    """Sequences in one step, at most the engine's built max_batch_size; None: the built one."""
    max_num_tokens: int | None = _option(None, "lower the engine's max_num_tokens", type=int)
    """Tokens in one step (prefill chunks and decodes), at most the built max_num_tokens; None: the built one."""
    num_kv_blocks: int | None = _option(
        None, "KV-cache blocks (default: what --kv-cache-memory-fraction allows)", type=int)
    """KV-cache blocks to allocate; None: what kv_cache_memory_fraction of the free memory holds (on the CPU:
    up to max_batch_size sequences of max_seq_len)."""
    enable_prefix_caching: bool = _option(
        True, "reuse the KV blocks of a prompt prefix seen before (--no-enable-prefix-caching: recompute)")
    """Keep finished requests' full KV blocks and reuse them for a later prompt with the same prefix."""
    kv_cache_memory_fraction: float = _option(
        0.9, "share of the memory left after weights and activations that the KV cache takes "
             "(CUDA graphs are captured in the rest)", type=float)
    """Share in (0, 1] of the memory left after the weights and one step's activations that the KV cache takes."""
    cuda_graphs: bool = _option(True, "on CUDA, run decode steps as CUDA graphs (--no-cuda-graphs: eagerly, "
                                      "for debugging)")
    """On CUDA, capture decode steps as CUDA graphs at startup (False: run them eagerly)."""
    async_scheduling: bool | None = _option(
        None, "schedule each step while the GPU runs the one before (default: on CUDA; --no-async-scheduling "
              "reads each step's tokens back first, for debugging)")
    """Schedule a step while the previous one still runs; None: on CUDA only (True turns it on off CUDA too)."""
    verify_checksums: bool = _option(
        True, "check the engine files' sha256 against engine.json's manifest, once per file version "
              "(--no-verify-checksums: sizes only)")
    """Check every engine file's sha256 against the manifest (hashed once per file version, then trusted through
    a stamp, see `kiln.engine_format.stamps`); False: sizes only."""
    capacity_scheduler_policy: str = _option(
        "max_utilization", "when a waiting request starts: max_utilization (at once; a request may be preempted "
        "and recomputed when KV blocks run short) or guaranteed_no_evict (once its prompt + max_tokens fit: "
        "never preempted)", type=str, choices=CAPACITY_POLICIES)
    """The scheduler's capacity policy (TensorRT-LLM's names; runtime/core/capacity.py): "max_utilization" or
    "guaranteed_no_evict"."""
    speculative_config: SpeculativeConfig | None = _option(
        None, "speculative decoding: --speculative-model/--speculative-mode, --num-speculative-tokens, "
              "--ngram-min, --ngram-max", flags="speculative")
    """Speculative decoding: a SpeculativeConfig, or its fields as a dict (vLLM's form), e.g.
    `{"method": "ngram", "num_speculative_tokens": 4}`; stored as a SpeculativeConfig. None: off."""

    enable_lora: bool = _option(False, "serve LoRA adapters (LLM.generate(..., lora_request=LoRARequest(...)))")
    """Accept LoRA adapters (Hugging Face PEFT directories) per request; off: a lora_request is refused."""
    max_loras: int = _option(4, "LoRA adapters held on the device at once (and the most one step mixes)", type=int)
    """Device slots for adapters: the most distinct adapters one step runs (more wait for a later step)."""
    max_lora_rank: int = _option(16, "largest LoRA rank served (a larger adapter is refused)", type=int)
    """The largest adapter rank; every slot is sized for it."""
    max_cpu_loras: int | None = _option(None, "LoRA adapters kept read in host memory (default: 2 * max_loras)",
                                        type=int)
    """Adapters kept in host memory (LRU) once read from disk; None: 2 * max_loras. At least max_loras."""

    kv_offloading_size: float = _option(
        0.0, "GiB of host memory (pinned on CUDA) that KV blocks evicted from the prefix cache move to and come "
             "back from, in all over the tensor-parallel ranks (0: off)", type=float)
    """The host tier of the prefix cache, in GiB over all tensor-parallel ranks (each rank holds size / tp_size,
    as vLLM's --kv-offloading-size); 0: off."""
    kv_offloading_dir: str | None = _option(
        None, "directory of the disk tier of the prefix cache: blocks the host tier evicts are written there and "
              "found again after a restart (needs --kv-offloading-size)", type=str)
    """The disk tier's directory (needs kv_offloading_size > 0); None: no disk tier."""
    kv_offloading_disk_size: float = _option(
        10.0, "GiB the disk tier (--kv-offloading-dir) may hold", type=float)
    """The most GiB of block files the disk tier keeps in kv_offloading_dir."""

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "num_kv_blocks", "max_loras", "max_lora_rank",
                     "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_kv_blocks is not None and self.num_kv_blocks > MAX_KV_BLOCKS:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} exceeds the limit {MAX_KV_BLOCKS}")
        fraction = self.kv_cache_memory_fraction
        if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction={fraction!r} must be in (0, 1]")
        # Normalized so that equal options compare equal (LLM took truthy values and a dict form before).
        object.__setattr__(self, "kv_cache_memory_fraction", float(fraction))
        object.__setattr__(self, "enable_prefix_caching", bool(self.enable_prefix_caching))
        object.__setattr__(self, "cuda_graphs", bool(self.cuda_graphs))
        object.__setattr__(self, "verify_checksums", bool(self.verify_checksums))
        if self.async_scheduling is not None:
            object.__setattr__(self, "async_scheduling", bool(self.async_scheduling))
        if self.capacity_scheduler_policy not in CAPACITY_POLICIES:
            raise ValueError(f"capacity_scheduler_policy={self.capacity_scheduler_policy!r} must be one of "
                             f"{', '.join(CAPACITY_POLICIES)}")
        object.__setattr__(self, "speculative_config", speculative_config_of(self.speculative_config))
        object.__setattr__(self, "enable_lora", bool(self.enable_lora))
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras}")
        self._check_kv_offloading()

    def _check_kv_offloading(self) -> None:
        for name, low in (("kv_offloading_size", "at least 0 (0: off)"),
                          ("kv_offloading_disk_size", "above 0")):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or value < 0 or (value == 0 and name == "kv_offloading_disk_size")):
                raise ValueError(f"{name}={value!r} must be a finite number of GiB, {low}")
            object.__setattr__(self, name, float(value))
        directory = self.kv_offloading_dir
        if directory is not None:
            if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
                raise ValueError(f"kv_offloading_dir={directory!r} must be a directory path")
            object.__setattr__(self, "kv_offloading_dir", str(os.fspath(directory)))
            if self.kv_offloading_size == 0:
                raise ValueError(f"kv_offloading_dir={directory!r} needs kv_offloading_size > 0: the disk tier "
                                 f"holds what the host tier evicts (--kv-offloading-dir needs --kv-offloading-size)")


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RuntimeOptions))


def runtime_options(options: RuntimeOptions | None, keywords: Mapping[str, Any], owner: str) -> RuntimeOptions:
    """`options` with `keywords` (RuntimeOptions' field names) set over it; what `LLM(engine_dir, *, options,
    **keywords)` and its kin take. An unknown keyword is a TypeError naming it and the valid ones."""
    unknown = [name for name in keywords if name not in FIELD_NAMES]
    if unknown:
        raise TypeError(f"{owner}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the runtime "
                        f"options are: {', '.join(FIELD_NAMES)}")
    if options is None:
        return RuntimeOptions(**keywords)
    if not isinstance(options, RuntimeOptions):
        raise TypeError(f"{owner}(options=...) must be a RuntimeOptions, got {type(options).__name__}")
    return dataclasses.replace(options, **keywords) if keywords else options
