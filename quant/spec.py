"""engine.json's `build_config.quantization`: what a quantized engine records about how it was made.

It is read back by the runtime (the format and group size pick the linear methods) and by people (the
ModelOpt version and the calibration data say how to reproduce it). A full-precision engine with a
full-precision KV cache records null.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kiln.engine_format.json_fields import check_json_fields

from .base import QuantConfig, QuantError
from .formats import GROUPED, QFORMATS, quant_config
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
    qformat: str  # one of QFORMATS
    kv_cache_dtype: str  # "auto" (the model dtype), "fp8" or "int8"
    group_size: int | None = None  # INT4 formats
    exclude_modules: tuple[str, ...] = DEFAULT_EXCLUDED
    modelopt_version: str | None = None  # when ModelOpt calibrated
    calibration: CalibrationRecord | None = None

    def __post_init__(self) -> None:
        if self.qformat not in QFORMATS:
            raise QuantError(f"qformat={self.qformat!r} must be one of {', '.join(QFORMATS)}")
        if self.kv_cache_dtype not in ("auto", "fp8", "int8"):
            raise QuantError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be auto, fp8 or int8")
        if (self.qformat in GROUPED) != (self.group_size is not None):
            raise QuantError(f"group_size={self.group_size!r} does not fit qformat {self.qformat}")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 2
                                            or self.group_size % 2):
            raise QuantError(f"group_size={self.group_size!r} must be an even integer >= 2")

    @property
    def is_noop(self) -> bool:
        return self.qformat == "full_prec" and self.kv_cache_dtype == "auto"

    def quant_config(self) -> QuantConfig | None:
        return quant_config(self.qformat, self.group_size, LayerSelection(tuple(self.exclude_modules)))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["exclude_modules"] = list(self.exclude_modules)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantSpec:
        """Raises QuantError naming the unknown, missing or bad key."""
        try:
            check_json_fields(cls, d)
        except ValueError as e:
            raise QuantError(str(e)) from None
        values = {**d, "exclude_modules": tuple(d.get("exclude_modules", DEFAULT_EXCLUDED))}
        if d.get("calibration") is not None:
            values["calibration"] = CalibrationRecord(**d["calibration"])
        return cls(**values)
