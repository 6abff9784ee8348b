"""Rotary position embedding (GPT-NeoX / Hugging Face "rotate_half" layout) applied to q and k.

The caller supplies cos/sin per token, so every scaling scheme (linear, dynamic NTK, llama3, yarn, longrope) is
just a different table: the operator never needs to know which one produced it. A table narrower than half
the head ([T, R/2] with R < D: partial rotary, Phi-4-mini) rotates the first R dimensions of each head
(rotate_half within them) and passes the other D - R through, as transformers' apply_rotary_pos_emb does.
"""

from __future__ import annotations

import torch

from ._checks import (
    FLOAT_DTYPES,
    check_dims,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    check_size,
)
from ._spec import OpSpec, define


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, 1, D/2] in x.dtype -> [T, H, D]
    # Hugging Face's x * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin) on the halves x = (x1, x2), in as few
    # ops: the swapped halves times sin, the first negated ((-x2) * sin is -(x2 * sin) exactly), plus x * cos.
    halves = x.unflatten(-1, (2, -1))  # [T, H, 2, D/2]
    swapped = halves.flip(-2).mul_(sin)  # [x2 * sin, x1 * sin]
    swapped[:, :, 0].neg_()
    return (halves * cos).add_(swapped).flatten(-2)


def rotary_embedding_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # Hugging Face casts the float32 table to the activation dtype before rotating; so do we.
    cos_q, sin_q = cos[:, None, None, :], sin[:, None, None, :]  # [T, 1, 1, R/2]
    if q.dtype != cos.dtype:
        cos_q, sin_q = cos_q.to(q.dtype), sin_q.to(q.dtype)
    rot = 2 * cos.shape[-1]  # R
    if rot == q.shape[-1]:
        return _rotate(q, cos_q, sin_q), _rotate(k, cos_q, sin_q)
    # partial rotary: [rotated first R dims, the rest as is]
    return tuple(torch.cat([_rotate(x[..., :rot], cos_q, sin_q), x[..., rot:]], dim=-1) for x in (q, k))


def _rotary_fake(q, k, cos, sin):
    return torch.empty_like(q), torch.empty_like(k)


# The rotary arguments, shared with the fused rotary + KV write (rotary_kv.py), which takes v between them.
ROTARY_QK = """
    Tensor q     [T, Hq, D] float32 / float16 / bfloat16, D even, last dim contiguous
    Tensor k     [T, Hk, D] q's dtype, last dim contiguous
"""
ROTARY_ANGLES = """
    Tensor cos   [T, R/2] float32, each token's angles; R <= D even, the rotated dims (R < D: partial rotary)
    Tensor sin   [T, R/2] float32
"""

ROTARY_EMBEDDING = OpSpec("kiln::rotary_embedding", ROTARY_QK + ROTARY_ANGLES + """
    -> Tensor    [T, Hq, D] rotated q
    -> Tensor    [T, Hk, D] rotated k
    """, reference=rotary_embedding_reference, fake=_rotary_fake, kernel="triton_rotary_kv.rotary_embedding_triton")
_rotary = define(ROTARY_EMBEDDING)


def check_rotary_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raises ValueError naming the bad argument of a rotary call; the fused rotary + KV write uses it too."""
    check_dims("q", q, 3)
    check_dims("k", k, 3)
    check_dims("cos", cos, 2)
    check_dtype("q", q, FLOAT_DTYPES)
    check_dtype("k", k, (q.dtype,))
    check_dtype("cos", cos, (torch.float32,))
    check_dtype("sin", sin, (torch.float32,))
    head_dim = q.shape[-1]
    if head_dim % 2 or k.shape[-1] != head_dim:
        raise ValueError(f"q and k need the same even head dim, got {head_dim} and {k.shape[-1]}")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        check_size(name, t, 0, q.shape[0], "tokens in q")
    if not 0 < cos.shape[1] <= head_dim // 2:  # partial rotary: fewer angles than half the head
        raise ValueError(f"cos has {cos.shape[1]} angles per token; it needs 1 to half the head dim "
                         f"({head_dim // 2})")
    check_size("sin", sin, 1, cos.shape[1], "cos's angles")
    check_same_device(q=q, k=k, cos=cos, sin=sin)
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("k", k)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q: [T, Hq, D] and k: [T, Hk, D] by the per-token angles cos, sin: [T, R/2] (float32): the first
    R dims of each head (all D, or fewer: partial rotary)."""
    check_rotary_args(q, k, cos, sin)
    return _rotary.for_tensor(q)(q, k, cos, sin)
