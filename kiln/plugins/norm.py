"""RMSNorm and fused residual-add + RMSNorm.

Both normalize in float32 and scale by the weight in the input dtype, exactly as Hugging Face's
LlamaRMSNorm does, so outputs match transformers bit for bit on the reference path.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_dtype, check_last_dim_contiguous, check_same_device, check_size
from ._spec import OpSpec, define


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # weight * (xf * rsqrt(mean(xf^2) + eps)).to(x.dtype) as Hugging Face writes it, the temporaries updated in
    # place (the same values: x.float() and .to() are no-ops in float32, the products commute).
    xf = x.float()
    inv_rms = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (xf * inv_rms).to(x.dtype).mul_(weight)


def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


RMS_NORM = OpSpec("kiln::rms_norm", """
    Tensor x        [..., H] float32 / float16 / bfloat16, last dim contiguous
    Tensor weight   [H] x's dtype
    float eps       added to the mean square before the square root
    -> Tensor       [..., H] x's dtype
    """, reference=rms_norm_reference, fake=_rms_norm_fake, kernel="triton_norm.rms_norm_triton")
_rms_norm = define(RMS_NORM)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual


def _fused_add_rms_norm_fake(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


FUSED_ADD_RMS_NORM = OpSpec("kiln::fused_add_rms_norm", """
    Tensor x          [T, H] float32 / float16 / bfloat16, last dim contiguous
    Tensor residual   [T, H] x's dtype
    Tensor weight     [H] x's dtype
    float eps         as rms_norm's
    -> Tensor         [T, H] rms_norm(x + residual)
    -> Tensor         [T, H] x + residual in x's dtype
    """, reference=fused_add_rms_norm_reference, fake=_fused_add_rms_norm_fake,
    kernel="triton_norm.fused_add_rms_norm_triton")
_fused_add_rms_norm = define(FUSED_ADD_RMS_NORM)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, (x.dtype,))
    check_size("weight", weight, 0, x.shape[-1], "hidden size of x")
    check_same_device(x=x, weight=weight)
    check_last_dim_contiguous("x", x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. x: [..., H]; weight: [H] (same dtype) -> [..., H]."""
    _check(x, weight)
    # float(eps): what the op's `float eps` hands its implementation, whichever of them runs.
    return _rms_norm.for_tensor(x)(x, weight, float(eps))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adds the residual and normalizes: returns (rms_norm(x + residual), x + residual).

    x, residual: [T, H] same dtype; weight: [H].
    """
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x: got {tuple(residual.shape)} {residual.dtype}, x is {tuple(x.shape)} {x.dtype}"
        )
    return _fused_add_rms_norm.for_tensor(x)(x, residual, weight, float(eps))
