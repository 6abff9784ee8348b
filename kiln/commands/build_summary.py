"""The lines `kiln build` prints about what it wrote: weight bytes and KV-cache bytes per token, next to
what full precision would take, how the engine was quantized, and which kernels were tuned for which GPU."""

from __future__ import annotations

from pathlib import Path

import torch


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def kv_bytes_per_token(model_config, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """Keys and values of one token over all layers, for `num_kv_heads` (default: the model's; a
    tensor-parallel rank's own with `Mapping.kv_heads_per_rank`). MLA: the compressed latent, every rank whole."""
    element = torch.empty((), dtype=dtype).element_size()
    if getattr(model_config, "mla", None) is not None:
        return model_config.num_layers * model_config.mla.latent_dim * element
    heads = model_config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * model_config.num_layers * heads * model_config.head_dim * element


def engine_summary(engine_dir: Path) -> str:
    from kiln.model_defs import build_network
    from kiln.runtime.worker.engine_loader import engine_quant_config, load_engine_info

    info = load_engine_info(engine_dir, verify_checksums=False)
    build, mapping = info.config.build, info.config.mapping
    with torch.device("meta"):
        full = build_network(info.model_def, info.model_config, dtype=build.torch_dtype)
    full_bytes = _tensor_bytes(full)
    if build.weights_at_load:  # no files: what each rank's network will draw
        quant = engine_quant_config(info)
        with torch.device("meta"):
            rank_bytes = [_tensor_bytes(build_network(info.model_def, info.model_config, quant, mapping.for_rank(r),
                                                      dtype=build.torch_dtype)) for r in range(mapping.num_ranks)]
    else:
        rank_bytes = [info.spec.rank_file(r).stat().st_size for r in range(info.spec.num_ranks)]
    heads = mapping.kv_heads_per_rank(info.model_config.num_kv_heads)
    kv = kv_bytes_per_token(info.model_config, build.kv_cache_torch_dtype, heads)
    kv_full = kv_bytes_per_token(info.model_config, build.torch_dtype, heads)
    quant = build.quantization or {}
    qformat = quant.get("qformat", "full_prec")
    how = f"{qformat}; {build.dtype} would be {_mib(full_bytes)}" if qformat != "full_prec" else f"{qformat}, {build.dtype}"
    if build.weights_at_load:
        how += "; dummy, drawn on the device at load: the engine holds no weight files"
    kv_how = build.kv_cache_dtype + (f"; {build.dtype} would be {kv_full:,}" if kv != kv_full else "")
    if mapping.tp_size == 1:
        lines = [f"weights {_mib(rank_bytes[0])} ({how})", f"KV cache {kv:,} bytes/token ({kv_how})"]
    else:
        # Each rank holds its own KV heads (one replicated head when there are fewer than ranks).
        ranks = ", ".join(f"rank{r} {_mib(n)}" for r, n in enumerate(rank_bytes))
        held = (f"{heads} of {info.model_config.num_kv_heads} KV heads each" if info.model_config.mla is None
                else "the MLA latent, whole on every rank")
        lines = [f"weights {_mib(sum(rank_bytes))} over {mapping.tp_size} ranks ({ranks}; {how})",
                 f"KV cache {kv:,} bytes/token per rank ({held}; {kv_how})"]
    calibration = quant.get("calibration")
    if calibration:
        lines.append(f"calibrated by ModelOpt {quant.get('modelopt_version')} on {calibration['dataset']}: "
                     f"{calibration['num_samples']} samples, {calibration['num_tokens']:,} tokens, "
                     f"{calibration['seconds']:.1f}s")
    tuned = info.spec.target.get("kernel_settings") or {}
    if tuned:
        kernels = ", ".join(f"{kernel} ({len(shapes)} shape{'s' * (len(shapes) != 1)})" for kernel, shapes in tuned.items())
        lines.append(f"kernels tuned for {info.spec.target.get('gpu_name')}: {kernels}")
    return "\n".join(lines)


def _tensor_bytes(network) -> int:
    return sum(t.numel() * t.element_size() for t in network.state_dict().values())
