"""The quantization half of `kiln build`: checks the format against the network before any work, runs
ModelOpt's calibration when the format or the KV cache needs it, and gives the writer its producer.

The formats, the calibration driver and the conversion live in `kiln.quant`; this file only puts them in
the build's order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.checkpoints.prequant.base import CheckpointQuantization
from kiln.checkpoints.prequant.mxfp4 import Mxfp4Checkpoint
from kiln.model_defs import ModelConfig, ModelDef
from kiln.quant.base import QuantConfig, QuantError
from kiln.quant.calib_data import DEFAULT_CALIB_SIZE, CalibrationTexts, read_calibration_texts
from kiln.quant.calibrate import CalibrationResult, calibrate
from kiln.quant.convert import (
    CheckpointParts,
    QuantizedProducer,
    dummy_parts,
    layer_modules,
    needs_calibration,
    quantize_parts,
    quantized_layers,
)
from kiln.quant.formats import KV_CACHE_QUANT_DTYPES, quant_config
from kiln.quant.rounding import FP8_MAX, int_max
from kiln.quant.spec import QuantSpec

from .build_config import BuildConfig
from .safetensors_writer import TensorSpec

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
    checkpoint_format: CheckpointQuantization | None = None  # a pre-quantized checkpoint's reader
    kv_cache: tuple[str, list[tuple[float, float]]] | None = None  # (dtype, scales) a checkpoint brings

    @property
    def kv_quantized(self) -> bool:
        return self.kv_cache is not None or self.config.kv_cache_dtype in KV_CACHE_QUANT_DTYPES

    @property
    def kv_cache_dtype(self) -> str:
        return self.kv_cache[0] if self.kv_cache is not None else self.config.kv_cache_dtype


def plan_quantization(config: BuildConfig, model_def: ModelDef, model_config: ModelConfig,
                      dtype: torch.dtype, checkpoint_format: CheckpointQuantization | None = None) -> QuantPlan | None:
    """None for a full-precision build. Raises QuantError for a layer the format cannot take (named, with
    its sizes) or a calibration file that cannot be read, before any weight is read. A pre-quantized
    checkpoint (`checkpoint_format`) is read as it is: asking to quantize it again is refused."""
    if model_config.mla is not None and config.kv_cache_dtype in KV_CACHE_QUANT_DTYPES:
        raise QuantError(f"--kv-cache-dtype {config.kv_cache_dtype} is not supported with multi-head latent "
                         f"attention (MLA, {model_config.architecture}) yet: its latent cache stays in the engine "
                         f"dtype; build without --kv-cache-dtype")
    moe = model_config.moe
    if checkpoint_format is None and config.dummy_weights and moe is not None and moe.mxfp4_experts and not (
            config.dequantize or config.quantizes):  # dummy weights of an MXFP4 config: its checkpoint's engine
        checkpoint_format = Mxfp4Checkpoint()
    if config.dequantize:
        checkpoint_format = _dequantized(config, checkpoint_format)  # None: a float engine
    if checkpoint_format is not None:
        if config.quantizes:
            flags = [f"--qformat {config.qformat.name}"] * (config.qformat.name != "full_prec") + \
                [f"--kv-cache-dtype {config.kv_cache_dtype}"] * (config.kv_cache_dtype != "auto")
            raise QuantError(f"the checkpoint is already quantized ({checkpoint_format.name}); {' and '.join(flags)} "
                             f"would quantize it again, which kiln does not offer: build it without those flags, "
                             f"or quantize the unquantized checkpoint")
        quant = checkpoint_format.quant_spec().quant_config()
        layers = {} if quant is None else quantized_layers(model_def, model_config, quant, dtype)
        if model_config.mla is not None and model_config.mla.fp8_block_size is not None:
            logger.info("%s: kv_b_proj (absorbed into MLA's query and output) and the routed experts (the fused MoE "
                        "operator takes float experts) are dequantized to %s at build; the other linears stay FP8",
                        checkpoint_format.name, str(dtype).removeprefix("torch."))
        return QuantPlan(config, quant, layers, False, None, checkpoint_format=checkpoint_format)
    if not config.quantizes:
        return None
    group = config.awq_block_size if config.qformat.grouped else None
    quant = quant_config(config.qformat, group)  # the entry --qformat was parsed into: no look-up by name
    layers = {} if quant is None else quantized_layers(model_def, model_config, quant, dtype)
    kv = config.kv_cache_dtype in KV_CACHE_QUANT_DTYPES
    wants = (needs_calibration(layers) or kv) and not config.dummy_weights
    if config.calib_dataset is not None and not wants:
        logger.warning("--calib-dataset is not used: --qformat %s%s needs no calibration", config.qformat.name,
                       " with --dummy-weights" if config.dummy_weights else "")
    data = read_calibration_texts(config.calib_dataset) if wants else None
    return QuantPlan(config, quant, layers, wants, data)


def _dequantized(config: BuildConfig, checkpoint_format: CheckpointQuantization | None) -> None:
    """--dequantize: the checkpoint's quantized weights are dequantized by the model's recipes into the engine
    dtype (the format is dropped), for the formats that allow it (`dequantizable`: MXFP4); QuantError for the
    others and for a checkpoint with nothing to dequantize."""
    if checkpoint_format is None:
        if config.dummy_weights:
            return None  # no checkpoint is read: a float engine either way
        raise QuantError("--dequantize: the checkpoint is not quantized (config.json has no quantization_config "
                         "kiln reads), so there is nothing to dequantize; build without --dequantize")
    if not getattr(checkpoint_format, "dequantizable", False):
        raise QuantError(f"--dequantize reads MXFP4 checkpoints (GPT-OSS) only; this checkpoint is "
                         f"{checkpoint_format.name}, which kiln keeps in its format: build without --dequantize")
    logger.info("--dequantize: %s dequantized to the engine dtype at build", checkpoint_format.name)
    return None


def run_calibration(plan: QuantPlan, checkpoint: Path, model_config: ModelConfig) -> None:
    if not plan.calibrate:
        return
    c = plan.config
    logger.info("calibrating %s%s with ModelOpt on %s (%s samples of up to %d tokens, %s)", c.qformat.name,
                f" + {c.kv_cache_dtype} KV cache" if plan.kv_quantized else "", plan.data.name,
                c.calib_size or f"up to {DEFAULT_CALIB_SIZE}", c.calib_max_seq_len, c.device)
    plan.result = calibrate(checkpoint, plan.quant, c.kv_cache_dtype, plan.data, c.calib_size,
                            c.calib_max_seq_len, c.device)
    if plan.kv_quantized and len(plan.result.kv_amax) != model_config.num_layers:
        raise QuantError(f"ModelOpt calibrated the KV cache of {len(plan.result.kv_amax)} attention layers; the "
                         f"model has {model_config.num_layers}")


def producer(plan: QuantPlan, model_def: ModelDef, model_config: ModelConfig,
             float_tensor: Callable[[str], torch.Tensor],
             read: Callable[[str], torch.Tensor] | None, names: set[str] = frozenset()) -> QuantizedProducer:
    """The writer's producer: `float_tensor(name)` makes an unquantized engine tensor, `read(part)` a
    checkpoint tensor (None with dummy weights), `names` the checkpoint's tensor names."""
    if plan.checkpoint_format is not None:
        fmt, modules = plan.checkpoint_format, layer_modules(model_def, model_config, plan.layers)

        def read_part(name: str) -> torch.Tensor:  # a tensor the checkpoint lacks is a KeyError for the format
            if name not in names:
                raise KeyError(name)
            return read(name)

        orders = row_orders(model_def, model_config, plan.layers)

        def make_layer(prefix: str, layer) -> dict[str, torch.Tensor]:
            tensors = fmt.layer_tensors(prefix, layer, modules[prefix], read_part)
            return tensors if prefix not in orders else fmt.reorder_rows(prefix, tensors, orders[prefix])

        return QuantizedProducer(plan.layers, make_layer, float_tensor)
    if read is None:
        parts = dummy_parts(float_tensor)
    else:
        linears = plan.result.linears if plan.result is not None and plan.layers else None
        parts = CheckpointParts(model_def, model_config, plan.layers, read, linears)
    return QuantizedProducer(plan.layers, quantize_parts(parts), float_tensor)


def row_orders(model_def: ModelDef, model_config: ModelConfig, layers: dict) -> dict[str, torch.Tensor]:
    """The quantized layers whose weight recipe transforms the checkpoint's rows (DeepSeek's rope rows), each with
    the row order it makes ([N] int64: engine row i is checkpoint row order[i]), found by running the transform on
    the row indices. QuantError for a transform of a fused layer or one that is not a reordering of rows."""
    recipes = model_def.recipes(model_config, [f"{prefix}.weight" for prefix in layers])
    orders = {}
    for prefix, layer in layers.items():
        recipe = recipes[f"{prefix}.weight"]
        if recipe.transform is None:
            continue
        rows = layer.out_features
        order = recipe.transform(f"{prefix}.weight", recipe.parts[0], torch.arange(rows)[:, None]).reshape(-1) \
            if len(recipe.parts) == 1 else None
        if order is None or not torch.equal(order.sort().values, torch.arange(rows)):
            raise QuantError(f"{prefix}: the model transforms this layer's checkpoint weight at build in a way a "
                             f"pre-quantized checkpoint cannot follow exactly (only a reordering of one part's rows)")
        orders[prefix] = order
    return orders


def checkpoint_tensors(plan: QuantPlan, model_def: ModelDef, model_config: ModelConfig) -> tuple[set[str], set[str]]:
    """(the quantized layers' float weight names, which the checkpoint does not hold as such; the checkpoint
    tensors the format reads instead) of a pre-quantized checkpoint."""
    fmt = plan.checkpoint_format
    modules = layer_modules(model_def, model_config, plan.layers)
    replaced = {f"{prefix}.weight" for prefix in plan.layers}
    used = {name for ms in modules.values() for m in ms for name in fmt.module_tensors(m)}
    return replaced, used | set(fmt.kv_scale_tensors(model_config.num_layers))


def recipe_specs(plan: QuantPlan | None, float_specs: list[TensorSpec], specs: list[TensorSpec]) -> list[TensorSpec]:
    """The tensors the checkpoint's recipes make: the float network's, plus those only the quantized network
    declares outside its quantized linear layers (an MXFP4 engine's experts: `weight_blocks`, `weight_scales`)."""
    if plan is None:
        return float_specs
    known = {s.name for s in float_specs}
    return float_specs + [s for s in specs if s.name not in known and s.name.rpartition(".")[0] not in plan.layers]


def read_checkpoint_kv_cache(plan: QuantPlan, read: Callable[[str], torch.Tensor], names: set[str],
                             num_layers: int) -> None:
    if plan.checkpoint_format is not None:
        plan.kv_cache = plan.checkpoint_format.kv_cache_scales(read, names, num_layers)


def kv_cache_scales(plan: QuantPlan, num_layers: int) -> list[tuple[float, float]] | None:
    """Per layer (k_scale, v_scale) = calibrated amax / the format's largest value."""
    if plan.kv_cache is not None:
        return plan.kv_cache[1]
    if not plan.kv_quantized:
        return None
    qmax = _KV_QMAX[plan.config.kv_cache_dtype]
    amax = plan.result.kv_amax if plan.result is not None else [(_DUMMY_KV_AMAX, _DUMMY_KV_AMAX)] * num_layers
    return [(max(k, 1e-6) / qmax, max(v, 1e-6) / qmax) for k, v in amax]


def quant_spec(plan: QuantPlan) -> QuantSpec:
    if plan.checkpoint_format is not None:
        return dataclasses.replace(plan.checkpoint_format.quant_spec(), kv_cache_dtype=plan.kv_cache_dtype
                                   if plan.kv_quantized else "auto")
    c = plan.config
    result = plan.result
    return QuantSpec(qformat=c.qformat.name, scheme=c.qformat, kv_cache_dtype=c.kv_cache_dtype,
                     group_size=c.awq_block_size if c.qformat.grouped else None,
                     modelopt_version=None if result is None else result.modelopt_version,
                     calibration=None if result is None else result.record)
