"""The quantization formats by their TensorRT-LLM names (`kiln build --qformat`), and the KV-cache ones."""

from __future__ import annotations

from typing import Any

from .base import QuantConfig, QuantError
from .fp8 import Fp8Config
from .int4_awq import Int4AwqConfig
from .int8_sq import Int8SqConfig
from .selection import LayerSelection
from .weight_only_formats import WeightOnlyConfig, int4_wo, int8_wo

QFORMATS = ("full_prec", "fp8", "int8_sq", "int4_awq", "int8_wo", "int4_wo")  # kiln build --qformat
# Schemes only pre-quantized checkpoints bring (quant/prequant/): FP8 with per-token dynamic activations,
# block-scaled FP8, INT8 with per-token dynamic activations, and weight-only integers of any layout.
CHECKPOINT_SCHEMES = ("fp8_dynamic", "fp8_block", "int8_dynamic", "weight_only")
ENGINE_SCHEMES = QFORMATS + CHECKPOINT_SCHEMES
GROUPED = ("int4_awq", "int4_wo")  # formats with a group size (--awq-block-size)
CALIBRATED = ("fp8", "int8_sq", "int4_awq")  # formats that need calibration data
KV_CACHE_QUANT_DTYPES = ("fp8", "int8")  # --kv-cache-dtype besides auto
DEFAULT_GROUP_SIZE = 128


def check_qformat(qformat: str) -> str:
    if qformat not in QFORMATS:
        raise QuantError(f"unknown --qformat {qformat!r}; valid: {', '.join(QFORMATS)}")
    return qformat


def quant_config(qformat: str, group_size: int | None = None, selection: LayerSelection | None = None, *,
                 bits: int | None = None, zero_point: bool = False, act_order: bool = False, smoothed: bool = False,
                 block_size: tuple[int, ...] | None = None) -> QuantConfig | None:
    """The scheme's QuantConfig (None for full_prec)."""
    if qformat not in ENGINE_SCHEMES:
        raise QuantError(f"unknown quantization scheme {qformat!r}; valid: {', '.join(ENGINE_SCHEMES)}")
    selection = selection or LayerSelection()
    group = group_size or DEFAULT_GROUP_SIZE
    configs: dict[str, Any] = {
        "full_prec": lambda: None,
        "fp8": lambda: Fp8Config(selection),
        "fp8_dynamic": lambda: Fp8Config(selection, dynamic=True),
        "fp8_block": lambda: fp8_block_config(tuple(block_size), selection),
        "int8_sq": lambda: Int8SqConfig(selection),
        "int8_dynamic": lambda: Int8SqConfig(selection, dynamic=True),
        "int4_awq": lambda: Int4AwqConfig(group_size=group, selection=selection),
        "int8_wo": lambda: int8_wo(selection),
        "int4_wo": lambda: int4_wo(group, selection),
        "weight_only": lambda: WeightOnlyConfig(bits, group_size, asymmetric=zero_point, smoothed=smoothed,
                                                act_order=act_order, selection=selection, group_flag=None),
    }
    return configs[qformat]()


def fp8_block_config(block_size: tuple[int, ...], selection: LayerSelection) -> QuantConfig:
    from .fp8_block import Fp8BlockConfig  # written with the block-scaled FP8 operator

    return Fp8BlockConfig(block_size, selection)
