"""SiLU-and-mul: the gated activation of Llama-family MLPs on the fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, check_dims, check_dtype, check_last_dim_contiguous
from ._eager import KernelOp
from ._triton import USE_TRITON


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2*I] = [gate | up] -> [T, I]
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]).mul_(x[..., half:])  # in place: silu's output is a fresh tensor


_silu_and_mul = KernelOp("kiln::silu_and_mul", silu_and_mul_reference)


@_silu_and_mul.op.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim. x: [T, 2*I] -> [T, I]."""
    check_dims("x", x, 2)
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"x.shape[-1] must be even (gate and up halves), got {x.shape[-1]}")
    return _silu_and_mul.for_tensor(x)(x)


if USE_TRITON:
    from .triton_activation import silu_and_mul_triton

    _silu_and_mul.register_kernel("cuda", silu_and_mul_triton)
