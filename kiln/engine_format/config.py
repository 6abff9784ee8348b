"""engine.json's `build_config`, typed: what the builder wrote and the runtime reads back once.

The builder's own input (`kiln.builder.build_config.BuildConfig`: "auto" dtype, target device, dummy
weights) resolves into an `EngineBuildConfig`; the runtime never sees the builder's options, only this.
"""

from __future__ import annotations

import collections.abc
import math
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from .limits import check_build_limits, check_max_beam_width
from .mapping import Mapping
from .spec import ENGINE_JSON, EngineError, EngineSpec

if TYPE_CHECKING:
    import torch


class TorchDtypes(collections.abc.Mapping):
    """engine.json's dtype names -> torch dtypes, torch imported at the first lookup: reading an engine's files
    (a Triton ensemble's text models, `kiln` commands that only inspect an engine) needs no torch."""

    def __init__(self, names: dict[str, str]) -> None:
        self._names = names  # engine.json name -> the attribute of torch

    def __getitem__(self, name: str) -> torch.dtype:
        import torch

        return getattr(torch, self._names[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# The dtypes an engine may hold its weights and activations in (engine.json build_config.dtype).
_ENGINE_NAMES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
ENGINE_DTYPES = TorchDtypes(_ENGINE_NAMES)
# The dtypes a KV cache may hold (engine.json build_config.kv_cache_dtype): the engine dtypes, or one of the
# quantized ones, which store k / k_scale and v / v_scale with one (k_scale, v_scale) pair per layer.
_QUANTIZED_KV_NAMES = {"fp8": "float8_e4m3fn", "int8": "int8"}
QUANTIZED_KV_CACHE_DTYPES = TorchDtypes(_QUANTIZED_KV_NAMES)
KV_CACHE_DTYPES = TorchDtypes({**_ENGINE_NAMES, **_QUANTIZED_KV_NAMES})

KVCacheScales = tuple[tuple[float, float], ...]  # per layer (k_scale, v_scale)


@dataclass(frozen=True)
class EngineBuildConfig:
    """The limits and storage formats an engine was built with. Limits are upper bounds for the runtime."""

    dtype: str  # activations and unquantized weights: a key of ENGINE_DTYPES
    max_batch_size: int  # requests per step
    max_num_tokens: int  # tokens per step (prefill chunks + decodes)
    max_seq_len: int  # prompt + output per request
    kv_block_size: int  # tokens per KV-cache block
    kv_cache_dtype: str  # the KV cache's own dtype, a key of KV_CACHE_DTYPES (separate from `dtype`)
    quantization: dict[str, Any] | None = None  # the weights' quantization, None for full precision
    dummy_weights: bool = False  # random weights from config.json alone (benchmarks)
    # Dummy weights drawn on the device at load: the engine holds no weight files (models whose weights do
    # not fit the disk can still be benchmarked).
    weights_at_load: bool = False
    # Per layer (k_scale, v_scale) of an "fp8" or "int8" cache (calibrated amax / 448 or amax / 127): a key k
    # is stored as k / k_scale and read back as stored * k_scale. None, and only None, for a float cache.
    # Its length is checked against the model's layers where the model config is known (the runtime).
    kv_cache_scales: KVCacheScales | None = None
    # Beams a beam-search request may have (`--max-beam-width`); engines written before it run 1.
    max_beam_width: int = 1

    def __post_init__(self) -> None:
        for name, allowed in (("dtype", ENGINE_DTYPES), ("kv_cache_dtype", KV_CACHE_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {', '.join(allowed)}")
        check_build_limits(max_batch_size=self.max_batch_size, max_num_tokens=self.max_num_tokens,
                           max_seq_len=self.max_seq_len, kv_block_size=self.kv_block_size)
        check_max_beam_width(self.max_beam_width)
        if self.quantization is not None and not isinstance(self.quantization, dict):
            raise ValueError(f"quantization={self.quantization!r} must be an object or null")
        for name in ("dummy_weights", "weights_at_load"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if self.weights_at_load and not self.dummy_weights:
            raise ValueError("weights_at_load=true needs dummy_weights=true: only dummy weights can be drawn at load")
        # Frozen: the normalized form (a tuple of float pairs, whatever sequences came in) is set once here.
        object.__setattr__(self, "kv_cache_scales", _check_kv_cache_scales(self.kv_cache_scales,
                                                                           self.kv_cache_dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return ENGINE_DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def kv_cache_quantized(self) -> bool:
        """Whether the KV cache stores scaled values (fp8, int8) that need `kv_cache_scales` to read."""
        return self.kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data: kv_cache_scales as a list of [k_scale, v_scale] lists."""
        d = asdict(self)
        if self.kv_cache_scales is not None:
            d["kv_cache_scales"] = [list(pair) for pair in self.kv_cache_scales]
        return d

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


def _positive_finite(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def _check_kv_cache_scales(scales: Any, kv_cache_dtype: str) -> KVCacheScales | None:
    """`scales` as a tuple of (k_scale, v_scale) float pairs; a ValueError naming the field and the value when
    they are malformed, missing for a quantized cache or given for a float one."""
    quantized = kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES
    if scales is None:
        if quantized:
            raise ValueError(f"kv_cache_scales=None: a kv_cache_dtype={kv_cache_dtype!r} cache needs one "
                             f"[k_scale, v_scale] pair of positive numbers per layer")
        return None
    if not quantized:
        raise ValueError(f"kv_cache_scales={scales!r} must be null for kv_cache_dtype={kv_cache_dtype!r} "
                         f"(scales are for {' and '.join(QUANTIZED_KV_CACHE_DTYPES)} caches)")
    if isinstance(scales, (str, bytes)) or not isinstance(scales, Sequence) or not scales:
        raise ValueError(f"kv_cache_scales={scales!r} must be a non-empty list of [k_scale, v_scale] pairs, "
                         f"one per layer")
    pairs = []
    for i, pair in enumerate(scales):
        if (isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2
                or not all(_positive_finite(x) for x in pair)):
            raise ValueError(f"kv_cache_scales[{i}]={pair!r} must be a [k_scale, v_scale] pair of positive "
                             f"finite numbers")
        pairs.append((float(pair[0]), float(pair[1])))
    return tuple(pairs)


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
