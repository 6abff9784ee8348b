"""engine.json's `build_config.quantization`: what a quantized engine records about how it was made.

It is read back by the runtime (the format and group size pick the linear methods) and by people (the
ModelOpt version and the calibration data say how to reproduce it). A full-precision engine with a
full-precision KV cache records null.
"""

from __future__ import annotations

from dataclasses import InitVar, asdict, dataclass
from typing import Any

from kiln.engine_format.json_fields import check_json_fields

from . import registry
from .base import QuantConfig, QuantError
from .formats import ENGINE_SCHEMES, quant_config
from .registry import QuantScheme, UnknownSchemeError
from .selection import DEFAULT_EXCLUDED, LayerSelection


@dataclass(frozen=True)
class CalibrationRecord:
    dataset: str  # the calibration file's name, or "kiln default sample (...)"
    num_samples: int
    max_seq_len: int
    num_tokens: int
    seconds: float


@dataclass(frozen=True)
class QuantSpec:
    """`qformat` is one of kiln build's formats (QFORMATS) or a scheme only a pre-quantized checkpoint
    brings (CHECKPOINT_SCHEMES); `source` names that checkpoint's format."""

    qformat: str  # one of ENGINE_SCHEMES
    kv_cache_dtype: str  # "auto" (the model dtype), "fp8" or "int8"
    group_size: int | None = None  # INT4 formats; weight_only: None = per channel
    exclude_modules: tuple[str, ...] = DEFAULT_EXCLUDED
    modelopt_version: str | None = None  # when ModelOpt calibrated
    calibration: CalibrationRecord | None = None
    bits: int | None = None  # weight_only: 4 or 8
    zero_point: bool = False  # weight_only: asymmetric, a zero point per group
    act_order: bool = False  # weight_only: GPTQ's g_idx (a group per input column)
    smoothed: bool = False  # weight_only: a pre_quant_scale [1, in] per layer (a ModelOpt AWQ export)
    block_size: tuple[int, ...] | None = None  # fp8_block: [rows, cols] of a weight-scale block
    source: str | None = None  # a pre-quantized checkpoint's format, e.g. "ModelOpt FP8 (hf_quant_config.json)"
    # The registry entry `qformat` names, when the caller has it already (kiln build's parsed --qformat): then
    # the name is not looked up again. Kept as `self.scheme` either way (quant_config uses it); not a field, so
    # engine.json and equality see only `qformat`. One naming another scheme (dataclasses.replace with a new
    # qformat carries the old one) is ignored and the name looked up.
    scheme: InitVar[QuantScheme | None] = None

    def __post_init__(self, scheme: QuantScheme | None) -> None:
        entry = scheme if scheme is not None and scheme.name == self.qformat else None
        if entry is None:
            try:
                entry = registry.scheme(self.qformat)
            except UnknownSchemeError:
                raise QuantError(f"qformat={self.qformat!r} must be one of {', '.join(ENGINE_SCHEMES)}") from None
        object.__setattr__(self, "scheme", entry)
        if self.kv_cache_dtype not in ("auto", "fp8", "int8"):
            raise QuantError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be auto, fp8 or int8")
        if entry.grouped and self.group_size is None:
            raise QuantError(f"group_size is required for qformat {self.qformat}")
        if "group_size" not in entry.parameters and self.group_size is not None:
            raise QuantError(f"group_size={self.group_size!r} does not fit qformat {self.qformat}")
        if ("bits" in entry.parameters) != (self.bits is not None) or self.bits not in (None, 4, 8):
            raise QuantError(f"bits={self.bits!r} does not fit qformat {self.qformat} (weight_only: 4 or 8)")
        if ("block_size" in entry.parameters) != (self.block_size is not None):
            raise QuantError(f"block_size={self.block_size!r} does not fit qformat {self.qformat}")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 2
                                            or self.group_size % 2):
            raise QuantError(f"group_size={self.group_size!r} must be an even integer >= 2")

    @property
    def is_noop(self) -> bool:
        return self.qformat == "full_prec" and self.kv_cache_dtype == "auto"

    def quant_config(self) -> QuantConfig | None:
        return quant_config(self.scheme, self.group_size, LayerSelection(tuple(self.exclude_modules)),
                            bits=self.bits, zero_point=self.zero_point, act_order=self.act_order, smoothed=self.smoothed,
                            block_size=self.block_size)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["exclude_modules"] = list(self.exclude_modules)
        d["block_size"] = None if self.block_size is None else list(self.block_size)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantSpec:
        """Raises QuantError naming the unknown, missing or bad key."""
        try:
            check_json_fields(cls, d)
        except ValueError as e:
            raise QuantError(str(e)) from None
        values = {**d, "exclude_modules": tuple(d.get("exclude_modules", DEFAULT_EXCLUDED))}
        if d.get("block_size") is not None:
            values["block_size"] = tuple(d["block_size"])
        if d.get("calibration") is not None:
            values["calibration"] = CalibrationRecord(**d["calibration"])
        return cls(**values)
