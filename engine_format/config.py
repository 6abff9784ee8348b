"""engine.json's `build_config`, typed: what the builder wrote and the runtime reads back once.

The builder's own input (`kiln.builder.build_config.BuildConfig`: "auto" dtype, target device, dummy
weights) resolves into an `EngineBuildConfig`; the runtime never sees the builder's options, only this.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

import torch

from .mapping import Mapping
from .spec import ENGINE_JSON, EngineError, EngineSpec

# The dtypes an engine may hold its weights and activations in (engine.json build_config.dtype).
ENGINE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class EngineBuildConfig:
    """The limits and storage formats an engine was built with. Limits are upper bounds for the runtime."""

    dtype: str  # activations and unquantized weights: a key of ENGINE_DTYPES
    max_batch_size: int  # requests per step
    max_num_tokens: int  # tokens per step (prefill chunks + decodes)
    max_seq_len: int  # prompt + output per request
    kv_block_size: int  # tokens per KV-cache block
    kv_cache_dtype: str  # the KV cache's own dtype, separate from `dtype` (an FP8 cache will differ)
    quantization: dict[str, Any] | None = None  # the weights' quantization, None for full precision
    dummy_weights: bool = False  # random weights from config.json alone (benchmarks)

    def __post_init__(self) -> None:
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in ENGINE_DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {', '.join(ENGINE_DTYPES)}")
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "kv_block_size"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.quantization is not None and not isinstance(self.quantization, dict):
            raise ValueError(f"quantization={self.quantization!r} must be an object or null")
        if not isinstance(self.dummy_weights, bool):
            raise ValueError(f"dummy_weights={self.dummy_weights!r} must be true or false")

    @property
    def torch_dtype(self) -> torch.dtype:
        return ENGINE_DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        return ENGINE_DTYPES[self.kv_cache_dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineBuildConfig:
        """Raises ValueError naming the missing, unknown or invalid key."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}")
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [name for name in required if name not in d]
        if missing:
            raise ValueError(f"missing key(s) {', '.join(missing)}")
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    """The typed halves of engine.json the runtime runs by, read once when an engine is loaded."""

    build: EngineBuildConfig
    mapping: Mapping


def read_engine_config(spec: EngineSpec) -> EngineConfig:
    """`spec`'s build_config and mapping, validated; an EngineError names the file, key and value."""
    path = spec.engine_dir / ENGINE_JSON
    hint = f"rebuild the engine with `kiln build --checkpoint ... --output {spec.engine_dir}`"
    try:
        build = EngineBuildConfig.from_dict(spec.build_config)
    except (ValueError, TypeError) as e:
        raise EngineError(f"{path}: build_config: {e}; {hint}") from None
    try:
        mapping = Mapping.from_dict(spec.mapping)
    except (ValueError, TypeError) as e:
        raise EngineError(f"{path}: mapping: {e}; {hint}") from None
    return EngineConfig(build=build, mapping=mapping)
