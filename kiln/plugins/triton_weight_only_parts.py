"""Triton side of `kiln::weight_only_linear_parts` (semantics: plugins/weight_only_parts.py): the layer's x smoothed
once per part ([P, T, K]), then one weight-only GEMM whose output tiles each read their part's x
(triton_weight_only._launch with part_sizes)."""

from __future__ import annotations

import torch

from ._parts import each_part
from .triton_weight_only import DEQUANT_MIN_TOKENS, _config, _launch, part_bounds, weight_only_linear_triton


def parts_fit(part_sizes: list[int] | tuple[int, ...], block_n: int) -> bool:
    """Whether one launch can compute a layer of these parts with block_n-wide tiles: at most three parts (two
    bounds), each bound on a tile edge."""
    bounds = part_bounds(part_sizes)
    return len(bounds) <= 2 and all(b % block_n == 0 for b in bounds)


def weight_only_linear_parts_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None,
    pre_quant_scale: torch.Tensor,
    part_sizes: list[int],
) -> torch.Tensor:
    """kiln::weight_only_linear_parts on CUDA (arguments as its reference, checked by the wrapper): x smoothed
    once per part, then one GEMM whose tiles each read their part's x. Parts that do not fall on tile edges,
    more than three, and prefill sizes that dequantize the weight run part by part."""
    t, n = x.shape[0], qweight.shape[0]
    if t == 0 or n == 0:
        return x.new_empty((t, n))
    if t < DEQUANT_MIN_TOKENS:
        cfg = _config(x, n, bits, group_size, False, zeros is not None,
                      lambda c: parts_fit(part_sizes, c.block_n))
        if parts_fit(part_sizes, cfg.block_n):
            return _launch(x, qweight, scales, zeros, bits, group_size, bias, pre_quant_scale, None, cfg,
                           part_sizes)
    return each_part(weight_only_linear_triton, x, qweight, scales, zeros, bits, group_size, bias, pre_quant_scale,
                     part_sizes)
