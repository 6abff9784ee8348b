"""ModelOpt's Hugging Face export (`export_hf_checkpoint`: `hf_quant_config.json`, and `quant_method:
"modelopt"` in config.json), read exactly.

| quant_algo | tensors per linear | kiln scheme |
| --- | --- | --- |
| FP8 | weight fp8 [out, in], weight_scale [], input_scale [] | fp8 (per-part weight scales expanded to rows) |
| FP8_PER_CHANNEL_PER_TOKEN | weight fp8, weight_scale [out] | fp8_dynamic |
| W8A8_SQ_PER_CHANNEL | weight int8, weight_scale [out], input_scale [], pre_quant_scale [in] | int8_sq |
| W4A16_AWQ | weight uint8 [out/2, in] (two int4 rows a byte), weight_scale [out, in/group], pre_quant_scale [in] on o_proj/down_proj (q/k/v's and gate/up's are folded into the norms) | weight_only 4-bit, smoothed |

KV cache (`kv_cache_quant_algo: FP8`): `self_attn.k_proj.k_scale` and `self_attn.v_proj.v_scale` (older
exports: `kv_scale` for both), scalar scales = amax / 448. The parts of a fused layer read one input, so
they get one input scale (the largest: ModelOpt's exporter already makes them equal) and must share one
pre_quant_scale (refused otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kiln.checkpoints.prequant.base import CheckpointQuantization, ReadTensor
from kiln.model_defs.layers.linear import Linear
from kiln.quant.base import QuantError
from kiln.quant.spec import QuantSpec

ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ")
_SCHEMES = {"FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8_dynamic", "W8A8_SQ_PER_CHANNEL": "int8_sq",
            "W4A16_AWQ": "weight_only"}
_KV_ALGOS = {None: None, "FP8": "fp8"}


def from_checkpoint(checkpoint: Path, quantization_config: dict[str, Any], hf_quant_config: dict[str, Any] | None,
                    names: set[str]) -> ModelOptCheckpoint:
    where = checkpoint / "hf_quant_config.json" if hf_quant_config is not None else checkpoint / "config.json"
    if hf_quant_config is not None:
        settings = hf_quant_config.get("quantization")
        if not isinstance(settings, dict):
            raise QuantError(f"{where}: 'quantization' must be an object")
        field = "quantization"
    else:
        settings, field = quantization_config, "quantization_config"
    algo = settings.get("quant_algo")
    if algo not in ALGOS:
        raise QuantError(f"{where}: {field}.quant_algo={algo!r} is not a ModelOpt format kiln reads; kiln reads "
                         f"{', '.join(ALGOS)}")
    kv = settings.get("kv_cache_quant_algo")
    if kv not in _KV_ALGOS:
        raise QuantError(f"{where}: {field}.kv_cache_quant_algo={kv!r} is not one kiln reads; kiln reads FP8 (or "
                         f"none)")
    group = settings.get("group_size", 128) if algo == "W4A16_AWQ" else None
    if algo == "W4A16_AWQ" and (settings.get("has_zero_point") or not isinstance(group, int) or group < 2):
        raise QuantError(f"{where}: {field}: W4A16_AWQ with has_zero_point={settings.get('has_zero_point')!r}, "
                         f"group_size={group!r}: kiln reads symmetric AWQ with an integer group size")
    exclude = settings.get("exclude_modules", settings.get("ignore", ["lm_head"]))
    if not isinstance(exclude, list) or not all(isinstance(x, str) for x in exclude):
        raise QuantError(f"{where}: {field}.exclude_modules={exclude!r} must be a list of module names")
    version = (hf_quant_config or quantization_config).get("producer", {}).get("version")
    return ModelOptCheckpoint(algo, group, _KV_ALGOS[kv], tuple(exclude), version, where.name)


class ModelOptCheckpoint(CheckpointQuantization):
    def __init__(self, algo: str, group_size: int | None, kv_cache_dtype: str | None, exclude: tuple[str, ...],
                 version: str | None, config_file: str) -> None:
        self.algo = algo
        self.group_size = group_size
        self.kv_cache_dtype = kv_cache_dtype
        self.exclude = exclude
        self.version = version
        self.name = f"ModelOpt {algo}{' + FP8 KV cache' if kv_cache_dtype else ''} ({config_file})"

    def quant_spec(self) -> QuantSpec:
        awq = self.algo == "W4A16_AWQ"
        return QuantSpec(qformat=_SCHEMES[self.algo], kv_cache_dtype=self.kv_cache_dtype or "auto",
                         group_size=self.group_size, exclude_modules=self.exclude, modelopt_version=self.version,
                         bits=4 if awq else None, smoothed=awq, source=self.name)

    def module_tensors(self, module: str) -> tuple[str, ...]:
        return tuple(f"{module}.{t}" for t in ("weight", "weight_scale", "input_scale", "pre_quant_scale"))

    def layer_tensors(self, prefix: str, layer: Linear, modules: Sequence[str],
                      read: ReadTensor) -> dict[str, torch.Tensor]:
        parts = [_Part(m, read) for m in modules]
        weights = [p.get("weight") for p in parts]
        if self.algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
            out = {"weight": torch.cat(weights),
                   "weight_scale": torch.cat([p.get("weight_scale").float().reshape(-1).expand(w.shape[0])
                                              for p, w in zip(parts, weights)]).contiguous()}
            if self.algo == "FP8":
                out["input_scale"] = _shared_input_scale(parts)
            return out
        if self.algo == "W8A8_SQ_PER_CHANNEL":
            return {"weight": torch.cat(weights),
                    "weight_scale": torch.cat([p.get("weight_scale").float().reshape(-1) for p in parts]),
                    "input_scale": _shared_input_scale(parts),
                    "pre_quant_scale": _shared_pre_quant_scale(prefix, parts, weights[0].shape[1])}
        # W4A16_AWQ: uint8 [out/2, in], row 2i in the low nibble and 2i+1 in the high one, two's complement.
        values = torch.cat([_unpack_rows(w) for w in weights])  # [out, in] int8 in -8..7
        from kiln.plugins.int4_pack import pack_int4

        in_features = values.shape[1]
        return {"qweight": pack_int4((values + 8).to(torch.uint8)),
                "scales": torch.cat([p.get("weight_scale").float() for p in parts]).contiguous(),
                "pre_quant_scale": _shared_pre_quant_scale(prefix, parts, in_features)[None, :]}

    def kv_scale_tensors(self, num_layers: int) -> tuple[str, ...]:
        return tuple(f"model.layers.{i}.self_attn.{p}.{s}" for i in range(num_layers)
                     for p, s in (("k_proj", "k_scale"), ("v_proj", "v_scale"), ("k_proj", "kv_scale"),
                                  ("v_proj", "kv_scale")))

    def kv_cache_scales(self, read: ReadTensor, names: set[str],
                        num_layers: int) -> tuple[str, list[tuple[float, float]]] | None:
        if self.kv_cache_dtype is None:
            return None
        scales = []
        for i in range(num_layers):
            attn = f"model.layers.{i}.self_attn"
            pair = []
            for proj, name in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
                found = [n for n in (f"{attn}.{proj}.{name}", f"{attn}.{proj}.kv_scale") if n in names]
                if not found:
                    raise QuantError(f"the checkpoint says kv_cache_quant_algo FP8 but has no {attn}.{proj}.{name}")
                pair.append(float(read(found[0]).float().reshape(-1)[0]))
            scales.append((pair[0], pair[1]))
        return self.kv_cache_dtype, scales


class _Part:
    """One checkpoint module's tensors, read on demand; a missing one is named."""

    def __init__(self, module: str, read: ReadTensor) -> None:
        self.module, self.read = module, read

    def get(self, name: str, required: bool = True) -> torch.Tensor | None:
        try:
            return self.read(f"{self.module}.{name}")
        except KeyError:
            if required:
                raise QuantError(f"the ModelOpt checkpoint has no {self.module}.{name}") from None
            return None


def _shared_input_scale(parts: list[_Part]) -> torch.Tensor:
    return torch.stack([p.get("input_scale").float().reshape(()) for p in parts]).max().reshape(1)


def _shared_pre_quant_scale(prefix: str, parts: list[_Part], in_features: int) -> torch.Tensor:
    """[in]: the parts' one pre_quant_scale, ones when the export folded it into the preceding norm."""
    scales = [p.get("pre_quant_scale", required=False) for p in parts]
    if all(s is None for s in scales):
        return torch.ones(in_features)
    if any(s is None for s in scales) or not all(torch.equal(s, scales[0]) for s in scales[1:]):
        raise QuantError(f"{prefix}: the parts {', '.join(p.module for p in parts)} have different pre_quant_scales, "
                         f"which one fused layer cannot apply exactly")
    return scales[0].float().contiguous()


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt's INT4 packing along rows: [out/2, in] uint8 -> [out, in] int8 (-8..7)."""
    low = (packed & 0x0F).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    rows = torch.stack([low, high], dim=1).reshape(-1, packed.shape[1])  # row 2i = low, 2i+1 = high
    return torch.where(rows >= 8, rows - 16, rows).to(torch.int8)
