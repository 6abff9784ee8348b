"""KV-cache write: scatter this step's keys and values into their paged slots.

Cache layout (per layer): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
A slot is block_id * block_size + offset; slot -1 means "skip" (padding tokens of a captured graph).
"""

from __future__ import annotations

import torch

from ._checks import check_dims, check_dtype, check_same_device, check_size
from ._eager import runs_reference_directly
from ._triton import USE_TRITON


def write_kv_cache_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # k, v: [T, Hk, D]; slot_mapping: [T] int64
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks * block_size, Hk, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    if slot_mapping.numel() and slot_mapping.min() < 0:  # padding tokens write nothing
        valid = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    k_flat.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


_write_kv_cache_op = torch.library.custom_op("kiln::write_kv_cache", mutates_args=("k_cache", "v_cache"))(
    write_kv_cache_reference)


@_write_kv_cache_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping):
    return None


def check_kv_write_args(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """Raises ValueError naming the bad argument of a KV-cache write; the fused rotary + write uses it too."""
    for name, t, nd in (("k", k, 3), ("v", v, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4),
                        ("slot_mapping", slot_mapping, 1)):
        check_dims(name, t, nd)
    check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} differs from k shape {tuple(k.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape and dtype")
    check_size("k_cache", k_cache, 2, k.shape[1], "kv heads of k")
    check_size("k_cache", k_cache, 3, k.shape[2], "head dim of k")
    check_size("slot_mapping", slot_mapping, 0, k.shape[0], "tokens in k")
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes k, v: [T, Hk, D] into k_cache, v_cache: [N, block_size, Hk, D] at slot_mapping: [T] int64."""
    check_kv_write_args(k, v, k_cache, v_cache, slot_mapping)
    op = write_kv_cache_reference if runs_reference_directly(k) else _write_kv_cache_op
    op(k, v, k_cache, v_cache, slot_mapping)


if USE_TRITON:
    from .triton_rotary_kv import write_kv_cache_triton

    _write_kv_cache_op.register_kernel("cuda")(write_kv_cache_triton)
