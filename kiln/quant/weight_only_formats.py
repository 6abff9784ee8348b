"""`int8_wo` and `int4_wo`: weight-only formats without calibration (their method is weight_only.py's).

- `int8_wo`: INT8 per output channel, symmetric round-to-nearest; no calibration data.
- `int4_wo`: INT4 per group of `group_size` input columns, asymmetric round-to-nearest (a zero point per
  group); no calibration data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .registry import QuantScheme, register
from .selection import LayerSelection
from .weight_only import WeightOnlyLinear, check_group_size


@dataclass(frozen=True)
class WeightOnlyConfig:
    """Every selected layer gets WeightOnlyLinear(bits, group_size, asymmetric, smoothed); a group size that
    does not divide a layer's input width is refused, naming the layer."""

    bits: int
    group_size: int | None = None  # None: per output channel
    asymmetric: bool = False
    smoothed: bool = False
    selection: LayerSelection = field(default_factory=LayerSelection)
    act_order: bool = False
    group_flag: str | None = "--awq-block-size"  # what sets group_size; None for a checkpoint's own

    def linear_method(self, prefix: str, in_features: int, out_features: int,
                      dtype: torch.dtype) -> WeightOnlyLinear | None:
        if not self.selection.quantizes(prefix):
            return None
        if self.group_size is not None:
            check_group_size(prefix, in_features, self.group_size, self.group_flag)
        return WeightOnlyLinear(self.bits, self.group_size, self.asymmetric, self.smoothed, dtype, self.act_order,
                                per_part_smoothing=isinstance(self, _PerPartSmoothing))

    def modelopt_config(self) -> None:
        return None


class _PerPartSmoothing:
    """Marks a config whose smoothing scale is kept per part of a fused layer (kiln's own AWQ)."""


def int8_wo(selection: LayerSelection) -> WeightOnlyConfig:
    return WeightOnlyConfig(8, selection=selection)


def int4_wo(group_size: int, selection: LayerSelection) -> WeightOnlyConfig:
    return WeightOnlyConfig(4, group_size, asymmetric=True, selection=selection)


register(QuantScheme("int8_wo", lambda p: int8_wo(p.selection), order=4))
register(QuantScheme("int4_wo", lambda p: int4_wo(p.group, p.selection), order=5,
                     parameters=frozenset({"group_size"}), grouped=True))
# Any weight-only integer layout a pre-quantized checkpoint (AWQ, GPTQ, compressed-tensors, ModelOpt) brings.
register(QuantScheme(
    "weight_only", order=9, buildable=False,
    config=lambda p: WeightOnlyConfig(p.bits, p.group_size, asymmetric=p.zero_point, smoothed=p.smoothed,
                                      act_order=p.act_order, selection=p.selection, group_flag=None),
    parameters=frozenset({"bits", "group_size", "zero_point", "act_order", "smoothed"})))
