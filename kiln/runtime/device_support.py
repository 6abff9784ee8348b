"""Load-time refusal of an engine whose storage formats the runtime device cannot compute.

FP8 (float8_e4m3fn) needs a GPU of compute capability 8.9 or newer (Ada, Hopper): older GPUs have no FP8
conversion or tensor-core instructions, so an FP8 KV cache or FP8 weights would fail deep inside a kernel,
after the weights were loaded. The CPU runs every format through the PyTorch references.
"""

from __future__ import annotations

import torch

from kiln.engine_format import EngineBuildConfig, EngineError

FP8_MIN_CAPABILITY = (8, 9)  # Ada Lovelace (sm_89) and Hopper (sm_90) onwards
FP8_WEIGHT_SCHEMES = ("fp8", "fp8_dynamic", "fp8_block")  # quantization.qformat values with FP8 weights


def check_device_supports(build: EngineBuildConfig, device: torch.device) -> None:
    """Raises EngineError, saying what to rebuild with, when `build` needs FP8 (an "fp8" KV cache or
    weights: qformat fp8, fp8_dynamic, fp8_block) and `device` is a CUDA GPU older than compute capability 8.9."""
    if device.type != "cuda":
        return
    needs = []
    if build.kv_cache_dtype == "fp8":
        needs.append(("an FP8 KV cache", "--kv-cache-dtype int8 or auto"))
    if isinstance(build.quantization, dict) and build.quantization.get("qformat") in FP8_WEIGHT_SCHEMES:
        needs.append(("FP8 weights", "--qformat int8_sq or int4_awq (from the unquantized checkpoint)"))
    if not needs:
        return
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability >= FP8_MIN_CAPABILITY:
        return
    what = " and ".join(n for n, _ in needs)
    flags = " and ".join(f for _, f in needs)
    minimum, found = (".".join(map(str, cc)) for cc in (FP8_MIN_CAPABILITY, capability))
    raise EngineError(
        f"the engine holds {what}, which needs a GPU of compute capability {minimum} or newer (Ada, Hopper), "
        f"but {device} has compute capability {found}: rebuild the engine with {flags} to run it on this GPU")
