"""The quantization formats by their TensorRT-LLM names (`kiln build --qformat`), and the KV-cache ones."""

from __future__ import annotations

from typing import Any

from .base import QuantConfig, QuantError
from .fp8 import Fp8Config
from .int4_awq import Int4AwqConfig
from .int8_sq import Int8SqConfig
from .selection import LayerSelection
from .weight_only_formats import int4_wo, int8_wo

QFORMATS = ("full_prec", "fp8", "int8_sq", "int4_awq", "int8_wo", "int4_wo")
GROUPED = ("int4_awq", "int4_wo")  # formats with a group size (--awq-block-size)
CALIBRATED = ("fp8", "int8_sq", "int4_awq")  # formats that need calibration data
KV_CACHE_QUANT_DTYPES = ("fp8", "int8")  # --kv-cache-dtype besides auto
DEFAULT_GROUP_SIZE = 128


def check_qformat(qformat: str) -> str:
    if qformat not in QFORMATS:
        raise QuantError(f"unknown --qformat {qformat!r}; valid: {', '.join(QFORMATS)}")
    return qformat


def quant_config(qformat: str, group_size: int | None = None,
                 selection: LayerSelection | None = None) -> QuantConfig | None:
    """The format's QuantConfig (None for full_prec)."""
    check_qformat(qformat)
    selection = selection or LayerSelection()
    group = group_size or DEFAULT_GROUP_SIZE
    configs: dict[str, Any] = {
        "full_prec": lambda: None,
        "fp8": lambda: Fp8Config(selection),
        "int8_sq": lambda: Int8SqConfig(selection),
        "int4_awq": lambda: Int4AwqConfig(group_size=group, selection=selection),
        "int8_wo": lambda: int8_wo(selection),
        "int4_wo": lambda: int4_wo(group, selection),
    }
    return configs[qformat]()
