"""Block-scaled FP8 weights (quant_method "fp8" with weight_block_size: DeepSeek-V3's release), dequantized at
build for the engine tensors a family keeps in float (DeepSeek's kv_b_proj and routed experts, deepseek.py).

A checkpoint stores such a weight [N, K] as `weight` float8_e4m3fn and `weight_scale_inv` float32
[ceil(N / b0), ceil(K / b1)], one scale per [b0, b1] block (the last ones may be partial) that multiplies
despite its name, as transformers' FineGrainedFP8 dequantizes it. The FP8 layers kept in the engine are read by
checkpoints/prequant/fp8_block.py instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .recipes import Combine, Single

SCALE = "weight_scale_inv"


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """weight: [N, K] float8_e4m3fn; scale: [ceil(N / b0), ceil(K / b1)] -> [N, K] float32, each element times its
    block's scale. ValueError naming the shapes when the scale does not fit the weight's blocks."""
    b0, b1 = block_size
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a block-scaled FP8 weight is float8_e4m3fn [out, in], got {weight.dtype} "
                         f"{list(weight.shape)}")
    n, k = weight.shape
    blocks = (-(-n // b0), -(-k // b1))
    if tuple(scale.shape) != blocks:
        raise ValueError(f"weight_scale_inv has shape {list(scale.shape)}, expected {list(blocks)} for a weight "
                         f"{[n, k]} in blocks of [{b0}, {b1}]")
    per_element = scale.float().repeat_interleave(b0, dim=0)[:n].repeat_interleave(b1, dim=1)[:, :k]  # [N, K]
    return weight.float() * per_element


@dataclass(frozen=True)
class DequantizeFp8Block:
    """A recipe's combine over (weight, weight_scale_inv) pairs of parts: each pair dequantized to float32
    (the writer casts the result to the engine dtype), then `inner` combines them as it would float parts."""

    block_size: tuple[int, int]
    inner: Combine = Single()

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        parts = list(parts)
        if len(parts) % 2:
            raise ValueError(f"{len(parts)} parts are not (weight, weight_scale_inv) pairs")
        return self.inner([dequantize_fp8_block(w, s, self.block_size) for w, s in zip(parts[::2], parts[1::2])])


def with_scales(weights: Sequence[str]) -> tuple[str, ...]:
    """('…x.weight', …) -> ('…x.weight', '…x.weight_scale_inv', …): the parts DequantizeFp8Block reads."""
    return tuple(name for w in weights for name in (w, f"{w.removesuffix('.weight')}.{SCALE}"))
