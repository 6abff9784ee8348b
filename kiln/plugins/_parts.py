"""The part-by-part product of a fused weight-only layer whose parts smooth x apart, shared by the reference of
kiln::weight_only_linear_parts and its CUDA fallback."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def each_part(linear: Callable[..., torch.Tensor], x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor | None, bits: int, group_size: int, bias: torch.Tensor | None,
              pre_quant_scale: torch.Tensor, part_sizes: Sequence[int]) -> torch.Tensor:
    """Concatenates linear(x, <part i's rows of qweight, scales, zeros, bias>, bits, group_size,
    pre_quant_scale[i]) over the parts: [T, N]. `linear` takes weight_only_linear_reference's arguments."""
    outputs, start = [], 0
    for i, rows in enumerate(part_sizes):
        part = slice(start, start + rows)
        start += rows
        outputs.append(linear(x, qweight[part], scales[part], None if zeros is None else zeros[part], bits,
                              group_size, None if bias is None else bias[part], pre_quant_scale[i]))
    return torch.cat(outputs, dim=-1)
