"""The quantization half of `kiln build`: checks the format against the network before any work, runs
ModelOpt's calibration when the format or the KV cache needs it, and gives the writer its producer.

The formats, the calibration driver and the conversion live in `kiln.quant`; this file only puts them in
the build's order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.model_defs import ModelConfig, ModelDef
from kiln.quant.base import QuantConfig, QuantError
from kiln.quant.calib_data import CalibrationTexts, read_calibration_texts
from kiln.quant.calibrate import CalibrationResult, calibrate
from kiln.quant.convert import (
    CheckpointParts,
    QuantizedProducer,
    dummy_parts,
    needs_calibration,
    quantized_layers,
)
from kiln.quant.formats import GROUPED, KV_CACHE_QUANT_DTYPES, quant_config
from kiln.quant.rounding import FP8_MAX, int_max
from kiln.quant.spec import QuantSpec

from .build_config import BuildConfig

logger = logging.getLogger("kiln.builder")

_KV_QMAX = {"fp8": FP8_MAX, "int8": float(int_max(8))}
_DUMMY_KV_AMAX = 8.0  # --dummy-weights with a quantized KV cache: a plausible range, for speed runs


@dataclass
class QuantPlan:
    """What the build does about quantization, decided before it reads any weight."""

    config: BuildConfig
    quant: QuantConfig | None
    layers: dict  # quantized Linear layers by module path (meta)
    calibrate: bool  # whether ModelOpt runs
    data: CalibrationTexts | None
    result: CalibrationResult | None = None

    @property
    def kv_quantized(self) -> bool:
        return self.config.kv_cache_dtype in KV_CACHE_QUANT_DTYPES


def plan_quantization(config: BuildConfig, model_def: ModelDef, model_config: ModelConfig,
                      dtype: torch.dtype) -> QuantPlan | None:
    """None for a full-precision build. Raises QuantError for a layer the format cannot take (named, with
    its sizes) or a calibration file that cannot be read, before any weight is read."""
    if not config.quantizes:
        return None
    group = config.awq_block_size if config.qformat in GROUPED else None
    quant = quant_config(config.qformat, group)
    layers = {} if quant is None else quantized_layers(model_def, model_config, quant, dtype)
    kv = config.kv_cache_dtype in KV_CACHE_QUANT_DTYPES
    wants = (needs_calibration(layers) or kv) and not config.dummy_weights
    if config.calib_dataset is not None and not wants:
        logger.warning("--calib-dataset is not used: --qformat %s%s needs no calibration", config.qformat,
                       " with --dummy-weights" if config.dummy_weights else "")
    data = read_calibration_texts(config.calib_dataset) if wants else None
    return QuantPlan(config, quant, layers, wants, data)


def run_calibration(plan: QuantPlan, checkpoint: Path, model_config: ModelConfig) -> None:
    if not plan.calibrate:
        return
    c = plan.config
    logger.info("calibrating %s%s with ModelOpt on %s (%d samples of up to %d tokens, %s)", c.qformat,
                f" + {c.kv_cache_dtype} KV cache" if plan.kv_quantized else "", plan.data.name, c.calib_size,
                c.calib_max_seq_len, c.device)
    plan.result = calibrate(checkpoint, plan.quant, c.kv_cache_dtype, plan.data, c.calib_size,
                            c.calib_max_seq_len, c.device)
    if plan.kv_quantized and len(plan.result.kv_amax) != model_config.num_layers:
        raise QuantError(f"ModelOpt calibrated the KV cache of {len(plan.result.kv_amax)} attention layers; the "
                         f"model has {model_config.num_layers}")


def producer(plan: QuantPlan, model_def: ModelDef, model_config: ModelConfig,
             float_tensor: Callable[[str], torch.Tensor],
             read: Callable[[str], torch.Tensor] | None) -> QuantizedProducer:
    """The writer's producer: `float_tensor(name)` makes an unquantized engine tensor, `read(part)` a
    checkpoint tensor (None with dummy weights)."""
    if read is None:
        parts = dummy_parts(float_tensor)
    else:
        linears = plan.result.linears if plan.result is not None and plan.layers else None
        parts = CheckpointParts(model_def, model_config, plan.layers, read, linears)
    return QuantizedProducer(plan.layers, parts, float_tensor)


def kv_cache_scales(plan: QuantPlan, num_layers: int) -> list[tuple[float, float]] | None:
    """Per layer (k_scale, v_scale) = calibrated amax / the format's largest value."""
    if not plan.kv_quantized:
        return None
    qmax = _KV_QMAX[plan.config.kv_cache_dtype]
    amax = plan.result.kv_amax if plan.result is not None else [(_DUMMY_KV_AMAX, _DUMMY_KV_AMAX)] * num_layers
    return [(max(k, 1e-6) / qmax, max(v, 1e-6) / qmax) for k, v in amax]


def quant_spec(plan: QuantPlan) -> QuantSpec:
    c = plan.config
    result = plan.result
    return QuantSpec(qformat=c.qformat, kv_cache_dtype=c.kv_cache_dtype,
                     group_size=c.awq_block_size if c.qformat in GROUPED else None,
                     modelopt_version=None if result is None else result.modelopt_version,
                     calibration=None if result is None else result.record)
