"""Loading an engine directory: checks it, resolves runtime limits, builds the model on its device."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from kiln.builder.build_config import ENGINE_DTYPES
from kiln.builder.engine_format import EngineError, EngineSpec, load_engine_spec
from kiln.model_defs import ModelConfig, ModelConfigError, get_model_def

from .memory import check_fraction

logger = logging.getLogger("kiln.runtime")


@dataclass(frozen=True)
class RuntimeConfig:
    """The limits the runtime runs with: the engine's build limits or smaller ones given at load."""

    device: torch.device
    dtype: torch.dtype
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    block_size: int
    num_kv_blocks: int | None  # None until the model runner has sized the cache from memory
    enable_prefix_caching: bool
    kv_cache_memory_fraction: float = 0.9  # share of the memory left after weights and activations
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs (on CUDA)


@dataclass(frozen=True)
class LoadedEngine:
    spec: EngineSpec
    model_config: ModelConfig
    model: nn.Module
    tokenizer: object | None  # a transformers tokenizer, or None for an engine without tokenizer files


def _override(name: str, value: int | None, built: int, flag: str) -> int:
    if value is None:
        return built
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    if value > built:
        raise ValueError(f"{name}={value} exceeds the engine's built limit {built}; rebuild with {flag} {value}")
    return value


def resolve_device(spec: EngineSpec, device: str | torch.device | None) -> torch.device:
    target = spec.target.get("device_type", "cpu")
    dev = torch.device(device if device is not None else target)
    if dev.type != target:
        raise EngineError(
            f"engine {spec.engine_dir} was built for device type {target!r} but is loaded on {dev.type!r}; "
            f"rebuild it with `kiln build --device {dev.type}`"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineError(f"engine {spec.engine_dir} targets CUDA but no CUDA device is available")
        cc = list(torch.cuda.get_device_capability(dev))
        built_cc = spec.target.get("compute_capability")
        if built_cc is not None and list(built_cc) != cc:
            raise EngineError(
                f"engine {spec.engine_dir} was tuned for {spec.target.get('gpu_name')} (compute capability "
                f"{built_cc}) but this GPU is {torch.cuda.get_device_name(dev)} ({cc}); rebuild it for this GPU"
            )
    return dev


def load_engine(engine_dir: str | Path, *, device: str | torch.device | None = None,
                max_batch_size: int | None = None, max_num_tokens: int | None = None,
                num_kv_blocks: int | None = None, enable_prefix_caching: bool = True,
                kv_cache_memory_fraction: float = 0.9, cuda_graphs: bool = True,
                verify_checksums: bool = False) -> tuple[LoadedEngine, RuntimeConfig]:
    """Checks and loads an engine directory; every failure is an EngineError or ValueError saying what to do."""
    start = time.perf_counter()
    spec = load_engine_spec(engine_dir, verify_checksums=verify_checksums)
    try:
        model_def = get_model_def(spec.architecture)
        config = ModelConfig.from_dict(spec.model_config)
    except (ModelConfigError, TypeError, KeyError) as e:
        raise EngineError(f"engine.json model_config is invalid: {e}; rebuild the engine") from e
    build = spec.build_config
    dtype_name = build.get("dtype")
    if dtype_name not in ENGINE_DTYPES:
        raise EngineError(f"engine.json build_config.dtype={dtype_name!r} is not one of {sorted(ENGINE_DTYPES)}")
    dtype = ENGINE_DTYPES[dtype_name]
    dev = resolve_device(spec, device)

    max_seq_len = int(build["max_seq_len"])
    block_size = int(build["kv_block_size"])
    batch = _override("max_batch_size", max_batch_size, int(build["max_batch_size"]), "--max-batch-size")
    tokens = _override("max_num_tokens", max_num_tokens, int(build["max_num_tokens"]), "--max-num-tokens")
    blocks = None if num_kv_blocks is None else _override("num_kv_blocks", num_kv_blocks, 2**31 - 1, "")
    fraction = check_fraction(kv_cache_memory_fraction)

    with torch.device("meta"):
        model = model_def.model_class(config)
    try:
        weights = load_file(str(spec.rank_file(0)), device=str(dev))
    except Exception as e:  # safetensors raises its own error types
        raise EngineError(f"cannot read {spec.rank_file(0)}: {e}; rebuild the engine") from e
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as e:
        raise EngineError(f"{spec.rank_file(0)} does not fit the model in engine.json: {e}") from e
    model.eval()

    tokenizer = None
    if spec.tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(spec.tokenizer_dir))
        # kiln checks lengths itself (against max_seq_len, with a clear error); transformers' own warning
        # about model_max_length would only be noise, e.g. for perplexity over a long text in windows.
        tokenizer.model_max_length = sys.maxsize
    logger.info("loaded engine %s (%s, %s, %s) in %.2fs", spec.engine_dir, spec.architecture, dtype_name, dev,
                time.perf_counter() - start)
    runtime = RuntimeConfig(device=dev, dtype=dtype, max_batch_size=batch, max_num_tokens=tokens,
                            max_seq_len=max_seq_len, block_size=block_size, num_kv_blocks=blocks,
                            enable_prefix_caching=enable_prefix_caching, kv_cache_memory_fraction=fraction,
                            cuda_graphs=bool(cuda_graphs))
    return LoadedEngine(spec, config, model, tokenizer), runtime
