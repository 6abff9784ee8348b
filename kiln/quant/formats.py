"""The quantization formats by their TensorRT-LLM names (`kiln build --qformat`), and the KV-cache ones."""

from __future__ import annotations

from .base import QuantConfig, QuantError
from .registry import DEFAULT_GROUP_SIZE as DEFAULT_GROUP_SIZE
from .registry import QuantScheme, SchemeParams, UnknownSchemeError, names, scheme
from .selection import LayerSelection

# Views of the registry (each scheme's module registers it), kept under their old names for the callers.
QFORMATS = names(buildable=True)  # kiln build --qformat
# Schemes only pre-quantized checkpoints bring (checkpoints/prequant/): FP8 with per-token dynamic activations,
# block-scaled FP8, INT8 with per-token dynamic activations, and weight-only integers of any layout.
CHECKPOINT_SCHEMES = names(buildable=False)
ENGINE_SCHEMES = QFORMATS + CHECKPOINT_SCHEMES
GROUPED = names(grouped=True)  # formats with a group size (--awq-block-size)
CALIBRATED = names(calibrated=True)  # formats that need calibration data
KV_CACHE_QUANT_DTYPES = ("fp8", "int8")  # --kv-cache-dtype besides auto


def parse_qformat(qformat: str) -> QuantScheme:
    """The scheme `kiln build --qformat <qformat>` makes: where a --qformat string becomes its registry entry,
    once (the CLI's flag, or BuildConfig given a name); inner layers take the entry. QuantError listing the
    valid names for any other."""
    if qformat not in QFORMATS:
        raise QuantError(f"unknown --qformat {qformat!r}; valid: {', '.join(QFORMATS)}")
    return scheme(qformat)


def check_qformat(qformat: str) -> str:
    return parse_qformat(qformat).name


def quant_config(qformat: str | QuantScheme, group_size: int | None = None, selection: LayerSelection | None = None,
                 *, bits: int | None = None, zero_point: bool = False, act_order: bool = False,
                 smoothed: bool = False, block_size: tuple[int, ...] | None = None) -> QuantConfig | None:
    """The scheme's QuantConfig (None for full_prec); `qformat` a scheme's name or its entry (no look-up)."""
    try:
        entry = qformat if isinstance(qformat, QuantScheme) else scheme(qformat)
    except UnknownSchemeError as e:
        raise QuantError(str(e)) from None
    return entry.config(SchemeParams(selection or LayerSelection(), group_size, bits, zero_point, act_order,
                                     smoothed, None if block_size is None else tuple(block_size)))
