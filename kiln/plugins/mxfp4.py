"""MXFP4 (the OCP microscaling format GPT-OSS's experts ship in), dequantized: blocks of 32 E2M1 values (4 bits:
sign, 2 exponent bits, 1 mantissa bit) sharing one E8M0 scale (a power of two, 2 ** (byte - 127)).

A weight [..., N] is stored as `blocks` [..., N / 32, 16] uint8 (two values a byte, the low nibble first) and
`scales` [..., N / 32] uint8, as transformers' integrations/mxfp4.py reads GPT-OSS's checkpoints. Dequantizing is
exact in float32 (and in bfloat16: each value is a 2-bit-mantissa number times a power of two).

Pure torch, on any device: the builder's `--dequantize` (model_defs/gpt_oss.py) and the MXFP4 MoE reference
(mxfp4_moe.py) use it; the Triton kernel (triton_mxfp4_moe.py) decodes the same bits in registers.
"""

from __future__ import annotations

import torch

# E2M1 codes 0..15 -> values: sign bit 8, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks: [..., G, 16] uint8; scales: [..., G] uint8 -> [..., G * 32] float32."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: blocks "
                         f"are [..., G, {BLOCK // 2}] for scales [..., G]")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - 127  # [..., G]
    return torch.ldexp(values, exponents[..., None].float()).flatten(-2)  # [..., G * 32]
