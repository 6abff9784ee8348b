"""Rotary embedding fused with the KV-cache write: rotates q and k, stores the rotated k and v in the paged
cache and returns the rotated q. Same result as rotary_embedding followed by write_kv_cache, but the GPU
runs one kernel per layer instead of two (and the rotated k never round-trips through memory).

A quantized cache (float8_e4m3fn, int8) takes k_scale, v_scale as write_kv_cache does; the Triton kernel
quantizes as the reference does.
"""

from __future__ import annotations

import torch

from ._eager import runs_reference_directly
from ._spec import OpSpec, define
from .kv_cache import KV_WRITE_ARGS, check_kv_write_args, plan_skips, write_kv_slots
from .rotary import ROTARY_ANGLES, ROTARY_QK, check_rotary_args, rotary_embedding_reference
from .step_plan import StepPlan, slots_skip


def rotary_embedding_and_write_kv_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return _rotate_and_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                             slots_skip(slot_mapping))


def _rotate_and_write(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None, skips: bool,
) -> torch.Tensor:
    # The reference, told whether any slot is -1 (`skips`: the step's plan knows without a host sync).
    q_rot, k_rot = rotary_embedding_reference(q, k, cos, sin)
    write_kv_slots(k_rot, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, skips)
    return q_rot


def _rotary_kv_fake(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    return torch.empty_like(q)


ROTARY_EMBEDDING_AND_WRITE_KV = OpSpec("kiln::rotary_embedding_and_write_kv", ROTARY_QK + """
    Tensor v     [T, Hk, D] k's dtype
    """ + ROTARY_ANGLES + KV_WRITE_ARGS + """
    -> Tensor    [T, Hq, D] rotated q
    """, reference=rotary_embedding_and_write_kv_reference, fake=_rotary_kv_fake,
    kernel="triton_rotary_kv.rotary_embedding_and_write_kv_triton")
_rotary_kv = define(ROTARY_EMBEDDING_AND_WRITE_KV)


def rotary_embedding_and_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    *, plan: StepPlan | None = None,
) -> torch.Tensor:
    """Rotates q: [T, Hq, D] and k: [T, Hk, D] by cos, sin: [T, R/2] (float32; R < D rotates the first R dims
    of each head only: partial rotary), writes the rotated k and
    v: [T, Hk, D] into k_cache, v_cache: [N, block_size, Hk, D] at slot_mapping: [T] int64 (-1 skips a
    token), and returns the rotated q: [T, Hq, D]. A float8_e4m3fn or int8 cache needs k_scale, v_scale
    ([1] float32 on its device) and stores k / k_scale, v / v_scale; a float cache takes no scales.
    `plan`: the step's `StepPlan` of this slot_mapping where the reference runs (None elsewhere)."""
    check_rotary_args(q, k, cos, sin)
    check_kv_write_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if not runs_reference_directly(q):
        return _rotary_kv.for_tensor(q)(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return _rotate_and_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                             plan_skips(plan, slot_mapping))
