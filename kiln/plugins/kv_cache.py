"""KV-cache write: scatter this step's keys and values into their paged slots.

Cache layout (per layer): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
A slot is block_id * block_size + offset; slot -1 means "skip" (padding tokens of a captured graph).

A quantized cache (float8_e4m3fn or int8, TensorRT-LLM's FP8 / INT8 KV cache) stores k / k_scale and
v / v_scale, rounded and saturated to the cache dtype; attention reads cache.float() * scale. The scales are
per layer, [1] float32 tensors on the cache's device; the Triton kernel on CUDA reads them from device
memory (no host sync, so the write can be captured in a CUDA graph) and stores the same bytes.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_dims, check_dtype, check_same_device, check_size
from ._eager import runs_reference_directly
from ._spec import OpSpec, define
from .step_plan import StepPlan, slots_skip

# Cache dtypes that hold scaled values, with the largest magnitude each stores (saturation bound).
QUANTIZED_KV_DTYPES = (torch.float8_e4m3fn, torch.int8)
KV_CACHE_DTYPES = FLOAT_DTYPES + QUANTIZED_KV_DTYPES
_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in the quantized cache dtype: saturated to +-448 for FP8, rounded to nearest and saturated
    to [-128, 127] for INT8. x: any shape; scale: [1] float32."""
    scaled = x.float() / scale
    if dtype == torch.int8:
        return torch.round(scaled).clamp_(-128, 127).to(torch.int8)
    return scaled.clamp_(-_FP8_MAX, _FP8_MAX).to(dtype)


def write_kv_cache_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    write_kv_slots(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, slots_skip(slot_mapping))


def write_kv_slots(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, skips: bool,
) -> None:
    """The reference write, told whether any slot is -1 (`slots_skip`, which reads the slots to the host)."""
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks * block_size, Hk, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    if skips:  # padding tokens write nothing
        valid = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    if k_scale is None:
        k_flat.index_copy_(0, slot_mapping, k if k.dtype == k_cache.dtype else k.to(k_cache.dtype))
        v_flat.index_copy_(0, slot_mapping, v if v.dtype == v_cache.dtype else v.to(v_cache.dtype))
        return
    # index_copy_ has no float8 kernel on the CPU: copy the bytes (both quantized dtypes are one byte).
    k_bytes = quantize_kv(k, k_scale, k_cache.dtype).view(torch.uint8)  # [T, Hk, D]
    v_bytes = quantize_kv(v, v_scale, v_cache.dtype).view(torch.uint8)
    k_flat.view(torch.uint8).index_copy_(0, slot_mapping, k_bytes)
    v_flat.view(torch.uint8).index_copy_(0, slot_mapping, v_bytes)


def plan_skips(plan: StepPlan | None, slot_mapping: torch.Tensor) -> bool:
    """Whether slot_mapping holds -1 entries, from the step's plan where given (no host sync): ValueError if the
    plan was made for another slot_mapping."""
    if plan is None:
        return slots_skip(slot_mapping)
    if plan.slot_mapping is not slot_mapping:
        raise ValueError("plan was made for another slot_mapping")
    return plan.skips_slots


def _write_kv_cache_fake(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    return None


# The cache arguments of a KV write, shared with the fused rotary + KV write (rotary_kv.py).
KV_WRITE_ARGS = """
    Tensor(a!) k_cache     [N, block_size, Hk, D] float, or float8_e4m3fn / int8 (quantized); contiguous
    Tensor(b!) v_cache     [N, block_size, Hk, D] k_cache's dtype, contiguous
    Tensor slot_mapping    [T] int64, block * block_size + offset of each token; -1 writes nothing
    Tensor? k_scale=None   [1] float32 on the cache's device for a quantized cache (stores k / k_scale)
    Tensor? v_scale=None   [1] float32, likewise for v
"""

WRITE_KV_CACHE = OpSpec("kiln::write_kv_cache", """
    Tensor k               [T, Hk, D] float
    Tensor v               [T, Hk, D] k's dtype
    """ + KV_WRITE_ARGS + """
    -> ()
    """, reference=write_kv_cache_reference, fake=_write_kv_cache_fake, kernel="triton_rotary_kv.write_kv_cache_triton")
_write_kv_cache = define(WRITE_KV_CACHE)


def check_kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> None:
    """Raises ValueError unless a quantized cache gets both scales ([1] float32 on its device) and a float
    cache none; attention checks its caches' scales with it too."""
    quantized = k_cache.dtype in QUANTIZED_KV_DTYPES
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            if quantized:
                raise ValueError(f"{name} is required for a {k_cache.dtype} KV cache (it stores x / scale)")
            continue
        if not quantized:
            raise ValueError(f"{name} is given but the KV cache is {k_cache.dtype}: scales are only for "
                             f"{' and '.join(str(d) for d in QUANTIZED_KV_DTYPES)} caches")
        if tuple(scale.shape) != (1,):
            raise ValueError(f"{name} must have shape (1,), got {tuple(scale.shape)}")
        check_dtype(name, scale, (torch.float32,))
        if scale.device != k_cache.device:
            raise ValueError(f"{name} is on {scale.device} but the KV cache is on {k_cache.device}")


def check_kv_write_args(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> None:
    """Raises ValueError naming the bad argument of a KV-cache write; the fused rotary + write uses it too."""
    for name, t, nd in (("k", k, 3), ("v", v, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4),
                        ("slot_mapping", slot_mapping, 1)):
        check_dims(name, t, nd)
    check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    check_dtype("k_cache", k_cache, KV_CACHE_DTYPES)
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
    check_kv_scales(k_cache, k_scale, v_scale)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    *, plan: StepPlan | None = None,
) -> None:
    """Writes k, v: [T, Hk, D] into k_cache, v_cache: [N, block_size, Hk, D] at slot_mapping: [T] int64.

    A float8_e4m3fn or int8 cache needs k_scale, v_scale ([1] float32, on the cache's device) and stores
    k / k_scale, v / v_scale; a float cache takes no scales. `plan`: the step's `StepPlan` of this
    slot_mapping where the reference runs (None elsewhere), which says whether any slot is -1."""
    check_kv_write_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if not runs_reference_directly(k):
        _write_kv_cache.for_tensor(k)(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    write_kv_slots(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, plan_skips(plan, slot_mapping))
