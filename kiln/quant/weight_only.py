"""Weight-only integer linear layers (W8A16, W4A16): the method `int8_wo`, `int4_wo` and `int4_awq` share.

Weights are stored as integers with float32 scales per group of `group_size` input columns (a group of
the whole row is per-channel); 4-bit values are packed two to a byte (plugins/int4_pack.py). Symmetric
4-bit values q in [-8, 7] are stored as q + 8; asymmetric ones as 0..15 with a zero point per group
(8-bit asymmetric ones, from pre-quantized checkpoints, as uint8 0..255 with a uint8 zero point).

AWQ's `pre_quant_scale` is kept per part of a fused layer ([parts, in]: q, k and v each with its own),
because AWQ searched each part's scale on its own: one shared scale (the mean, as ModelOpt's exporter
makes) measured +5.9% perplexity on kiln-tiny-code against +3.6% for the calibrated model itself. The
product is then `weight_only_linear_parts`: on CUDA one GEMM whose tiles read their part's smoothed x.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kiln.model_defs.layers.linear import TensorDecl
from kiln.plugins.int4_pack import pack_int4
from kiln.plugins.quant_linear import weight_only_linear
from kiln.plugins.weight_only_parts import weight_only_linear_parts

from .base import LinearPart, QuantError, QuantizedLinearMethod
from .rounding import TINY, amax_floor, group_view, int_max, int_quantize


def check_group_size(prefix: str, in_features: int, group_size: int, flag: str | None) -> None:
    """A layer whose input width the group size does not divide fails before any work, named; `flag` is the
    option that sets the group size (None: a pre-quantized checkpoint's own, which kiln cannot change)."""
    if in_features % group_size:
        fix = (f"pass a {flag} that divides {in_features} (e.g. 64 or 32)" if flag else
               "the checkpoint's quantization_config group_size does not fit this model's layers")
        raise QuantError(f"{prefix}: in_features {in_features} is not divisible by the group size {group_size}; {fix}")


@dataclass(frozen=True)
class WeightOnlyLinear(QuantizedLinearMethod):
    """bits 4 or 8; group_size None = one group per row (per channel); `asymmetric` adds zero points
    (4-bit only); `smoothed` adds AWQ's pre_quant_scale."""

    bits: int
    group_size: int | None
    asymmetric: bool = False
    smoothed: bool = False
    dtype: torch.dtype = torch.float32
    act_order: bool = False  # GPTQ's desc_act: `g_idx` [in] int32 names each input column's group
    # smoothed: one pre_quant_scale per part of a fused layer ([parts, in]: kiln's AWQ) or one for all
    # ([1, in]: a ModelOpt export, which resmoothed the parts to one scale and folded it into the norm)
    per_part_smoothing: bool = True

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits} must be 4 or 8")

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.smoothed

    def group(self, in_features: int) -> int:
        return self.group_size or in_features

    def layer_tensors(self, layer: nn.Module, in_features: int, out_features: int,
                      bias: bool) -> dict[str, TensorDecl]:
        return self.tensors(in_features, out_features, bias, layer.output_sizes)

    def tensors(self, in_features: int, out_features: int, bias: bool,
                output_sizes: tuple[int, ...] | None = None) -> dict[str, TensorDecl]:
        groups = in_features // self.group(in_features)
        packed = (out_features, in_features // 2) if self.bits == 4 else (out_features, in_features)
        # 8-bit: signed values when symmetric, unsigned 0..255 with a zero point when asymmetric.
        unsigned = self.bits == 4 or self.asymmetric
        decls = {"qweight": TensorDecl(packed, torch.uint8 if unsigned else torch.int8),
                 "scales": TensorDecl((out_features, groups), torch.float32)}
        if self.asymmetric:
            decls["zeros"] = TensorDecl((out_features, groups), torch.uint8)
        if self.smoothed:
            parts = len(output_sizes or (out_features,)) if self.per_part_smoothing else 1
            decls["pre_quant_scale"] = TensorDecl((parts, in_features), torch.float32)
        if self.act_order:
            decls["g_idx"] = TensorDecl((in_features,), torch.int32)
        if bias:
            decls["bias"] = TensorDecl((out_features,), self.dtype)
        return decls

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        group, zeros, bias = self.group(x.shape[-1]), getattr(layer, "zeros", None), getattr(layer, "bias", None)
        pqs = getattr(layer, "pre_quant_scale", None)  # [parts, in] or None
        if self.act_order:
            return weight_only_linear(x, layer.qweight, layer.scales, zeros, bits=self.bits, group_size=group,
                                      bias=bias, g_idx=layer.g_idx)
        if pqs is None or pqs.shape[0] == 1:
            return weight_only_linear(x, layer.qweight, layer.scales, zeros, bits=self.bits, group_size=group,
                                      bias=bias, pre_quant_scale=None if pqs is None else pqs[0])
        # each part with its own smoothing of x, in one product
        return weight_only_linear_parts(x, layer.qweight, layer.scales, zeros, bits=self.bits, group_size=group,
                                        bias=bias, pre_quant_scale=pqs, part_sizes=layer.output_sizes)

    def quantize(self, parts: Sequence[LinearPart]) -> dict[str, torch.Tensor]:
        weight = torch.cat([p.weight.float() for p in parts])  # [out, in]
        group = self.group(weight.shape[1])
        if self.asymmetric:
            if self.bits != 4:
                raise QuantError("kiln builds asymmetric weights in 4 bits only (int4_wo)")
            qweight, scales, zeros = _asymmetric(weight, group, self.bits)
        else:
            amax = torch.cat([_part_amax(p, group) for p in parts])  # [out, groups]
            scales = amax_floor(amax) / int_max(self.bits)
            q = int_quantize(group_view(weight, group), scales[..., None], self.bits).reshape(weight.shape)
            qweight, zeros = (pack_int4((q + 8).to(torch.uint8)) if self.bits == 4 else q), None
        out = {"qweight": qweight, "scales": scales.contiguous()}
        if zeros is not None:
            out["zeros"] = zeros
        if self.smoothed:
            ones = torch.ones(weight.shape[1])
            out["pre_quant_scale"] = torch.stack([ones if p.pre_quant_scale is None else p.pre_quant_scale.float()
                                                  for p in parts])
        return out


def _part_amax(part: LinearPart, group: int) -> torch.Tensor:
    """The part's amax per group, [out_i, in / group]: ModelOpt's block amax when it gave one."""
    out_i, in_features = part.weight.shape
    if part.weight_amax is not None and part.weight_amax.numel() == out_i * (in_features // group):
        return part.weight_amax.float().reshape(out_i, in_features // group)
    return group_view(part.weight.float(), group).abs().amax(dim=-1)


def _asymmetric(weight: torch.Tensor, group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest with a zero point per group: the range [min, max] (0 included, so that zero is
    exact) maps onto 0..2^bits - 1. Returns (packed uint8 [out, in / 2], scales [out, groups] float32,
    zeros [out, groups] uint8)."""
    levels = 2 ** bits - 1
    grouped = group_view(weight, group)  # [out, groups, group]
    lo = grouped.amin(dim=-1).clamp(max=0.0)
    hi = grouped.amax(dim=-1).clamp(min=0.0)
    scales = ((hi - lo) / levels).clamp(min=TINY)  # [out, groups]
    zeros = torch.round(-lo / scales).clamp(0, levels)
    q = (torch.round(grouped / scales[..., None]) + zeros[..., None]).clamp(0, levels)
    return pack_int4(q.reshape(weight.shape).to(torch.uint8)), scales, zeros.to(torch.uint8)
