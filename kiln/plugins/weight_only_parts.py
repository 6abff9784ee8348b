"""A fused weight-only layer whose parts smooth x apart: `kiln::weight_only_linear_parts`.

kiln's AWQ keeps a pre_quant_scale per part of a fused layer (q, k, v; gate, up: quant/weight_only.py says
why), so each part multiplies a differently smoothed x. As separate weight_only_linear calls that is one
GEMM per part plus a concatenation, and the small k and v GEMMs use a GPU poorly (an H100 runs the 8B
model's q, k and v GEMMs at one token in 26 us, the fused [q; k; v] in 13). This op computes the same thing
in one product: on CUDA x is smoothed once per part into [P, T, K] and one GEMM launch gives every output
tile its part's x (triton_weight_only.py); the reference is the per-part loop itself.
"""

from __future__ import annotations

import torch

from ._checks import check_dims, check_dtype, check_same_device, check_size
from ._parts import each_part
from ._spec import OpSpec, define
from .quant_linear import (
    WEIGHT_ONLY_ARGS,
    _check_bias_and_smoothing,
    _check_quantized_weight,
    _check_x,
    _optional,
    weight_only_linear_reference,
)


def weight_only_linear_parts_reference(
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
    return each_part(weight_only_linear_reference, x, qweight, scales, zeros, bits, group_size, bias,
                     pre_quant_scale, part_sizes)


def _weight_only_linear_parts_fake(x, qweight, scales, zeros, bits, group_size, bias, pre_quant_scale, part_sizes):
    return x.new_empty((x.shape[0], qweight.shape[0]))


# qweight, scales, zeros, bias: the whole layer's N rows, the parts' rows in order.
WEIGHT_ONLY_LINEAR_PARTS = OpSpec("kiln::weight_only_linear_parts", WEIGHT_ONLY_ARGS + """
    Tensor pre_quant_scale    [P, K] float32, part i's smoothing of x
    SymInt[] part_sizes       the P parts' row counts, adding up to N
    -> Tensor                 [T, N] x's dtype
    """, reference=weight_only_linear_parts_reference, fake=_weight_only_linear_parts_fake,
    kernel="triton_weight_only_parts.weight_only_linear_parts_triton")
_weight_only_linear_parts = define(WEIGHT_ONLY_LINEAR_PARTS)


def weight_only_linear_parts(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    pre_quant_scale: torch.Tensor,
    part_sizes: list[int] | tuple[int, ...],
) -> torch.Tensor:
    """weight_only_linear of a fused layer whose P parts each smooth x with their own scale: x: [T, K] ->
    [T, N], equal to concatenating weight_only_linear(x, <part i's rows>, pre_quant_scale=pre_quant_scale[i]).

    qweight, scales, zeros, bias as weight_only_linear for the whole layer (N rows); pre_quant_scale:
    [P, K] float32; part_sizes: the P parts' row counts, adding up to N. No act-order g_idx.
    """
    k = _check_quantized_weight(qweight, scales, zeros, bits, group_size)
    _check_x(x, k, "input features of qweight")
    _check_bias_and_smoothing(x, qweight.shape[0], k, bias, None)
    sizes = list(part_sizes)
    if not sizes or any(type(s) is not int or s <= 0 for s in sizes) or sum(sizes) != qweight.shape[0]:
        raise ValueError(f"part_sizes {sizes} must be positive row counts adding up to the {qweight.shape[0]} "
                         f"output features of qweight")
    check_dims("pre_quant_scale", pre_quant_scale, 2)
    check_dtype("pre_quant_scale", pre_quant_scale, (torch.float32,))
    check_size("pre_quant_scale", pre_quant_scale, 0, len(sizes), "parts (len(part_sizes))")
    check_size("pre_quant_scale", pre_quant_scale, 1, k, "input features of qweight")
    check_same_device(x=x, qweight=qweight, pre_quant_scale=pre_quant_scale, **_optional(bias=bias))
    return _weight_only_linear_parts.for_tensor(x)(x, qweight, scales, zeros, bits, group_size, bias,
                                                   pre_quant_scale, sizes)
