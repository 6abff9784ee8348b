"""`int8_sq`: INT8 SmoothQuant W8A8 (ModelOpt's INT8_SMOOTHQUANT_CFG): per-channel weight scales, a
static per-tensor activation scale, and the smoothing factors.

SmoothQuant moves activation outliers into the weights: the weight's input columns are multiplied by s
and the input by 1/s (`pre_quant_scale`, applied before the input is quantized). kiln keeps the
pre_quant_scale as a tensor of the layer rather than folding it into the preceding norm: exact for
every layer, o_proj and down_proj included, which have no norm before them. `int8_dynamic`
(pre-quantized checkpoints only: compressed-tensors' W8A8) has neither smoothing nor an input scale: each
token's activations are scaled by their own amax at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.model_defs.layers.linear import TensorDecl
from kiln.plugins.quant_linear import scaled_linear

from .base import LinearPart, QuantizedLinearMethod
from .fusion import share_pre_quant_scale, shared_input_amax
from .registry import QuantScheme, register
from .rounding import amax_floor, int_max, int_quantize
from .selection import LayerSelection


@dataclass(frozen=True)
class Int8SqLinear(QuantizedLinearMethod):
    dtype: torch.dtype = torch.float32
    dynamic: bool = False  # per-token activation scales, no smoothing (int8_dynamic)
    needs_calibration: ClassVar[bool] = True

    def tensors(self, in_features: int, out_features: int, bias: bool) -> dict[str, TensorDecl]:
        decls = {"weight": TensorDecl((out_features, in_features), torch.int8),
                 "weight_scale": TensorDecl((out_features,), torch.float32)}  # per output channel
        if not self.dynamic:
            decls["input_scale"] = TensorDecl((1,), torch.float32)
            decls["pre_quant_scale"] = TensorDecl((in_features,), torch.float32)
        if bias:
            decls["bias"] = TensorDecl((out_features,), self.dtype)
        return decls

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        return scaled_linear(x, layer.weight, layer.weight_scale, getattr(layer, "input_scale", None),
                             getattr(layer, "bias", None), getattr(layer, "pre_quant_scale", None))

    def quantize(self, parts: Sequence[LinearPart]) -> dict[str, torch.Tensor]:
        parts = share_pre_quant_scale(parts)
        qmax = int_max(8)
        weights, scales = [], []
        for p in parts:
            amax = p.weight_amax.reshape(-1) if p.weight_amax is not None else p.weight.abs().amax(dim=1)
            scale = amax_floor(amax) / qmax  # [out_i]
            weights.append(int_quantize(p.weight, scale[:, None], 8))
            scales.append(scale)
        layer = parts[0].name.rsplit(".", 1)[0]
        in_features = parts[0].weight.shape[1]
        pqs = parts[0].pre_quant_scale
        return {"weight": torch.cat(weights), "weight_scale": torch.cat(scales),
                "input_scale": amax_floor(shared_input_amax(parts, layer)) / qmax,
                "pre_quant_scale": (torch.ones(in_features) if pqs is None else pqs.float()).contiguous()}


@dataclass(frozen=True)
class Int8SqConfig:
    selection: LayerSelection = field(default_factory=LayerSelection)
    dynamic: bool = False

    def linear_method(self, prefix: str, in_features: int, out_features: int,
                      dtype: torch.dtype) -> Int8SqLinear | None:
        return Int8SqLinear(dtype, self.dynamic) if self.selection.quantizes(prefix) else None

    def modelopt_config(self) -> dict[str, Any]:
        import modelopt.torch.quantization as mtq

        return mtq.INT8_SMOOTHQUANT_CFG


register(QuantScheme("int8_sq", lambda p: Int8SqConfig(p.selection), order=2, calibrated=True))
register(QuantScheme("int8_dynamic", lambda p: Int8SqConfig(p.selection, dynamic=True), order=8, buildable=False))
