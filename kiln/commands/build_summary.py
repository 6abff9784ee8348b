"""The lines `kiln build` prints about what it wrote: weight bytes and KV-cache bytes per token, next to
what full precision would take, and how the engine was quantized."""

from __future__ import annotations

from pathlib import Path

import torch


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def kv_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """Keys and values of one token over all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * element


def engine_summary(engine_dir: Path) -> str:
    from kiln.model_defs import build_network
    from kiln.runtime.engine_loader import load_engine_info

    info = load_engine_info(engine_dir, verify_checksums=False)
    build = info.config.build
    weights = sum(info.spec.rank_file(r).stat().st_size for r in range(info.spec.num_ranks))
    with torch.device("meta"):
        full = build_network(info.model_def, info.model_config, dtype=build.torch_dtype)
    full_bytes = sum(t.numel() * t.element_size() for t in full.state_dict().values())
    kv = kv_bytes_per_token(info.model_config, build.kv_cache_torch_dtype)
    kv_full = kv_bytes_per_token(info.model_config, build.torch_dtype)
    quant = build.quantization or {}
    qformat = quant.get("qformat", "full_prec")
    lines = [f"weights {_mib(weights)} ({qformat}" + (f"; {build.dtype} would be {_mib(full_bytes)})"
                                                      if qformat != "full_prec" else f", {build.dtype})"),
             f"KV cache {kv:,} bytes/token ({build.kv_cache_dtype}"
             + (f"; {build.dtype} would be {kv_full:,})" if kv != kv_full else ")")]
    calibration = quant.get("calibration")
    if calibration:
        lines.append(f"calibrated by ModelOpt {quant.get('modelopt_version')} on {calibration['dataset']}: "
                     f"{calibration['num_samples']} samples, {calibration['num_tokens']:,} tokens, "
                     f"{calibration['seconds']:.1f}s")
    return "\n".join(lines)
