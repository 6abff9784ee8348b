"""`fp8`: FP8 E4M3 weights and activations (W8A8), per-tensor scales, static activation scales from
ModelOpt's calibration (FP8_DEFAULT_CFG, "max"). `fp8_dynamic` (pre-quantized checkpoints only: ModelOpt's
FP8_PER_CHANNEL_PER_TOKEN, compressed-tensors' FP8_DYNAMIC) has no input scale: each token's activations
are scaled by their own amax at run time.

A fused qkv/gate_up layer keeps each part's own weight scale, expanded to its rows: exact, no
requantization (the GEMM takes row-wise weight scales).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.model_defs.layers.fp8_input import Fp8Input
from kiln.model_defs.layers.linear import TensorDecl
from kiln.plugins.quant_linear import scaled_linear, scaled_linear_quantized

from .base import LinearPart, QuantizedLinearMethod
from .fusion import shared_input_amax
from .registry import QuantScheme, register
from .rounding import FP8_MAX, amax_floor, fp8_quantize
from .selection import LayerSelection


@dataclass(frozen=True)
class Fp8Linear(QuantizedLinearMethod):
    dtype: torch.dtype = torch.float32
    dynamic: bool = False  # per-token activation scales at run time instead of a calibrated input_scale
    needs_calibration: ClassVar[bool] = True
    # The norm or SiLU-and-mul before the layer writes its input in FP8 (no pre_quant_scale to apply first).
    accepts_fp8_input: ClassVar[bool] = True

    def tensors(self, in_features: int, out_features: int, bias: bool) -> dict[str, TensorDecl]:
        decls = {"weight": TensorDecl((out_features, in_features), torch.float8_e4m3fn),
                 "weight_scale": TensorDecl((out_features,), torch.float32)}  # per row
        if not self.dynamic:
            decls["input_scale"] = TensorDecl((1,), torch.float32)
        if bias:
            decls["bias"] = TensorDecl((out_features,), self.dtype)
        return decls

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        return scaled_linear(x, layer.weight, layer.weight_scale, getattr(layer, "input_scale", None),
                             getattr(layer, "bias", None))

    def apply_fp8(self, layer: nn.Module, x: Fp8Input) -> torch.Tensor:
        # x.x_q: [T, in] float8_e4m3fn, x.x_scale: [T, 1] -> [T, out] in the network's dtype
        return scaled_linear_quantized(x.x_q, x.x_scale, layer.weight, layer.weight_scale,
                                       getattr(layer, "bias", None), out_dtype=self.dtype)

    def quantize(self, parts: Sequence[LinearPart]) -> dict[str, torch.Tensor]:
        weights, row_scales = [], []
        for p in parts:
            amax = p.weight_amax if p.weight_amax is not None else p.weight.abs().amax()
            scale = amax_floor(amax).reshape(()) / FP8_MAX
            weights.append(fp8_quantize(p.weight, scale))
            row_scales.append(scale.expand(p.out_features))
        layer = parts[0].name.rsplit(".", 1)[0]
        return {"weight": torch.cat(weights), "weight_scale": torch.cat(row_scales).contiguous(),
                "input_scale": amax_floor(shared_input_amax(parts, layer)) / FP8_MAX}


@dataclass(frozen=True)
class Fp8Config:
    selection: LayerSelection = field(default_factory=LayerSelection)
    dynamic: bool = False

    def linear_method(self, prefix: str, in_features: int, out_features: int,
                      dtype: torch.dtype) -> Fp8Linear | None:
        return Fp8Linear(dtype, self.dynamic) if self.selection.quantizes(prefix) else None

    def modelopt_config(self) -> dict[str, Any]:
        import modelopt.torch.quantization as mtq

        return mtq.FP8_DEFAULT_CFG


FP8_MIN_CAPABILITY = (8, 9)  # float8_e4m3fn: Ada Lovelace (sm_89) and Hopper (sm_90) onwards

register(QuantScheme("fp8", lambda p: Fp8Config(p.selection), order=1, calibrated=True,
                     min_compute_capability=FP8_MIN_CAPABILITY))
register(QuantScheme("fp8_dynamic", lambda p: Fp8Config(p.selection, dynamic=True), order=6,
                     min_compute_capability=FP8_MIN_CAPABILITY, buildable=False))
