"""Load-time refusal of an engine whose storage formats the runtime device cannot compute.

FP8 (float8_e4m3fn) needs a GPU of compute capability 8.9 or newer (Ada, Hopper): older GPUs have no FP8
conversion or tensor-core instructions, so an FP8 KV cache or FP8 weights would fail deep inside a kernel,
after the weights were loaded. The CPU runs every format through the PyTorch references.
"""

from __future__ import annotations

import torch

from kiln.engine_format import EngineBuildConfig, EngineError
from kiln.quant.fp8 import FP8_MIN_CAPABILITY
from kiln.quant.registry import schemes

# FP8_MIN_CAPABILITY (Ada Lovelace sm_89, Hopper sm_90 onwards) is the FP8 KV cache's; a weight scheme's
# own minimum is its registry entry's min_compute_capability.
__all__ = ["FP8_MIN_CAPABILITY", "check_device_supports"]


def check_device_supports(build: EngineBuildConfig, device: torch.device) -> None:
    """Raises EngineError, saying what to rebuild with, when `build` needs a newer CUDA GPU than `device`: an
    "fp8" KV cache, or a weight scheme whose registry entry has a min_compute_capability (fp8, fp8_dynamic,
    fp8_block: 8.9)."""
    if device.type != "cuda":
        return
    needs = []  # (what, the flags that avoid it, the compute capability it needs)
    if build.kv_cache_dtype == "fp8":
        needs.append(("an FP8 KV cache", "--kv-cache-dtype int8 or auto", FP8_MIN_CAPABILITY))
    qformat = build.quantization.get("qformat") if isinstance(build.quantization, dict) else None
    weights = next((s for s in schemes() if s.name == qformat and s.min_compute_capability), None)
    if weights is not None:
        needs.append(("FP8 weights", "--qformat int8_sq or int4_awq (from the unquantized checkpoint)",
                      weights.min_compute_capability))
    if not needs:
        return
    capability = tuple(torch.cuda.get_device_capability(device))
    minimum_cc = max(cc for _, _, cc in needs)
    if capability >= minimum_cc:
        return
    what = " and ".join(n for n, _, _ in needs)
    flags = " and ".join(f for _, f, _ in needs)
    minimum, found = (".".join(map(str, cc)) for cc in (minimum_cc, capability))
    raise EngineError(
        f"the engine holds {what}, which needs a GPU of compute capability {minimum} or newer (Ada, Hopper), "
        f"but {device} has compute capability {found}: rebuild the engine with {flags} to run it on this GPU")
