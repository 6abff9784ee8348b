"""The rounding every format shares, exactly as ModelOpt's fake quantization and the kernels do it.

Integer formats are symmetric with scale = amax / (2^(bits-1) - 1) and round half to even (torch.round);
FP8 E4M3 has scale = amax / 448 and rounds to nearest on the cast.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
TINY = 1e-12  # floor for an amax of zero (an all-zero row or block), so that scales are never 0


def int_max(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale as float8_e4m3fn; scale broadcasts against x (a scalar, or [N, 1] for rows)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def int_quantize(x: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """round(x / scale) clamped to the signed range of `bits`, as int8 (int4 values too, before packing)."""
    return torch.round(x.float() / scale).clamp(-int_max(bits) - 1, int_max(bits)).to(torch.int8)


def amax_floor(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=TINY)


def group_view(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, K / group_size, group_size]."""
    n, k = weight.shape
    return weight.reshape(n, k // group_size, group_size)
