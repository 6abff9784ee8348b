"""SiLU-and-mul: the gated activation of Llama-family MLPs on the fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, check_dims, check_dtype, check_last_dim_contiguous
from ._spec import OpSpec, define


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]).mul_(x[..., half:])  # in place: silu's output is a fresh tensor


def _silu_and_mul_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


SILU_AND_MUL = OpSpec("kiln::silu_and_mul", """
    Tensor x    [T, 2*I] = [gate | up], float32 / float16 / bfloat16, last dim contiguous
    -> Tensor   [T, I] silu(gate) * up in x's dtype
    """, reference=silu_and_mul_reference, fake=_silu_and_mul_fake, kernel="triton_activation.silu_and_mul_triton")
_silu_and_mul = define(SILU_AND_MUL)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim. x: [T, 2*I] -> [T, I]."""
    check_dims("x", x, 2)
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"x.shape[-1] must be even (gate and up halves), got {x.shape[-1]}")
    return _silu_and_mul.for_tensor(x)(x)
