"""`fp8_block`: block-scaled FP8 (pre-quantized checkpoints only: DeepSeek-V3's and Qwen3's FP8 releases).

Weights are FP8 E4M3 with one float32 scale per [b0, b1] block (`weight_scale_inv`, which multiplies despite
its name); activations are quantized at run time per token and per group of b1 input columns. The product is
plugins/fp8_block_linear.py's.

A fused qkv/gate_up layer is its parts' weights and scales concatenated by rows. That is exact only when
every part but the last ends on a block boundary (a multiple of b0 rows), since a block row's scale covers
b0 consecutive rows; the checkpoint reader checks it (checkpoints/prequant/fp8_block.py), as only it knows the parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from kiln.model_defs.layers.linear import TensorDecl
from kiln.plugins.fp8_block_linear import fp8_block_linear

from .base import LinearPart, QuantError, QuantizedLinearMethod
from .fp8 import FP8_MIN_CAPABILITY
from .registry import QuantScheme, register
from .rounding import FP8_MAX, amax_floor, fp8_quantize
from .selection import LayerSelection


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_block_size(block_size: Sequence[int]) -> tuple[int, int]:
    """(b0, b1) as ints; QuantError for anything but two positive integers."""
    sizes = tuple(block_size) if isinstance(block_size, (tuple, list)) else ()
    if len(sizes) != 2 or any(type(b) is not int or b <= 0 for b in sizes):
        raise QuantError(f"block_size={block_size!r} must be two positive integers [rows, columns]")
    return sizes  # type: ignore[return-value]


def block_amax(weight: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """weight: [N, K] -> [ceil(N / b0), ceil(K / b1)] float32, the amax of each block (partial last blocks
    padded with zeros, which change no amax)."""
    b0, b1 = block_size
    n, k = weight.shape
    nb, kb = cdiv(n, b0), cdiv(k, b1)
    padded = torch.nn.functional.pad(weight.float().abs(), (0, kb * b1 - k, 0, nb * b0 - n))  # [nb*b0, kb*b1]
    return padded.view(nb, b0, kb, b1).amax(dim=(1, 3))


def expand_blocks(scales: torch.Tensor, block_size: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """[ceil(N / b0), ceil(K / b1)] -> [N, K]: each element's block scale."""
    b0, b1 = block_size
    return scales.repeat_interleave(b0, dim=0)[:n].repeat_interleave(b1, dim=1)[:, :k]


@dataclass(frozen=True)
class Fp8BlockLinear(QuantizedLinearMethod):
    """weight: [out, in] float8_e4m3fn; weight_scale_inv: [ceil(out / b0), ceil(in / b1)] float32;
    bias: [out] in `dtype` when the layer has one."""

    block_size: tuple[int, int]
    dtype: torch.dtype = torch.float32

    def tensors(self, in_features: int, out_features: int, bias: bool) -> dict[str, TensorDecl]:
        b0, b1 = self.block_size
        decls = {"weight": TensorDecl((out_features, in_features), torch.float8_e4m3fn),
                 "weight_scale_inv": TensorDecl((cdiv(out_features, b0), cdiv(in_features, b1)), torch.float32)}
        if bias:
            decls["bias"] = TensorDecl((out_features,), self.dtype)
        return decls

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        return fp8_block_linear(x, layer.weight, layer.weight_scale_inv, self.block_size,
                                getattr(layer, "bias", None))

    def quantize(self, parts: Sequence[LinearPart]) -> dict[str, torch.Tensor]:
        # From float weights the blocks may straddle parts: they are blocks of the fused weight, made here.
        weight = torch.cat([p.weight.float() for p in parts])  # [out, in]
        scale = amax_floor(block_amax(weight, self.block_size)) / FP8_MAX  # [out / b0, in / b1]
        q = fp8_quantize(weight, expand_blocks(scale, self.block_size, *weight.shape))
        return {"weight": q, "weight_scale_inv": scale.contiguous()}


@dataclass(frozen=True)
class Fp8BlockConfig:
    """Every selected layer gets Fp8BlockLinear(block_size): any sizes, the last blocks may be partial."""

    block_size: tuple[int, int]
    selection: LayerSelection = field(default_factory=LayerSelection)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", check_block_size(self.block_size))

    def linear_method(self, prefix: str, in_features: int, out_features: int,
                      dtype: torch.dtype) -> Fp8BlockLinear | None:
        return Fp8BlockLinear(self.block_size, dtype) if self.selection.quantizes(prefix) else None

    def modelopt_config(self) -> None:
        return None  # read from checkpoints, never calibrated


register(QuantScheme("fp8_block", lambda p: Fp8BlockConfig(tuple(p.block_size), p.selection), order=7,
                     parameters=frozenset({"block_size"}), min_compute_capability=FP8_MIN_CAPABILITY,
                     buildable=False))
