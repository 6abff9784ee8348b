"""Two 4-bit values per byte: the storage of kiln's INT4 weights (W4A16).

Column k of a row lives in byte k // 2 of that row: the low nibble holds an even k, the high nibble the odd
k + 1 after it, so a kernel reading one byte gets two neighbouring columns of the same group. Values are
the unsigned nibbles 0..15; what they mean (q + 8 for symmetric weights, or q with a zero point) is the
business of the dequantizer in quant_linear.py. Pure torch: runs on any device.
"""

from __future__ import annotations

import torch

from ._checks import check_dtype


def _check_packable(name: str, t: torch.Tensor) -> None:
    if t.dim() < 1:
        raise ValueError(f"{name} must have at least 1 dim, got a scalar")
    check_dtype(name, t, (torch.uint8,))


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """Packs u: [..., K] uint8 values 0..15 (K even) into [..., K // 2] uint8, low nibble first.

    Raises ValueError for an odd K or a value above 15 (the check reads the values: a build-time helper,
    not one for a step's hot path).
    """
    _check_packable("u", u)
    k = u.shape[-1]
    if k % 2:
        raise ValueError(f"u.shape[-1] (K) must be even to pack two 4-bit values a byte, got {k}")
    if u.numel() and int(u.max()) > 15:
        raise ValueError(f"u holds values up to {int(u.max())}; 4-bit values must be in 0..15")
    return u[..., 0::2] | (u[..., 1::2] << 4)  # [..., K // 2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: packed: [..., K // 2] uint8 -> [..., K] uint8 values 0..15."""
    _check_packable("packed", packed)
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [..., K // 2, 2]: (even k, odd k)
    return nibbles.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
