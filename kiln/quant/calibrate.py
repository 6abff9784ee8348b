"""Calibration with NVIDIA ModelOpt: the checkpoint in transformers, ModelOpt's quantization config for the
format (and the KV cache), its calibration forward passes over the calibration samples, and what it
measured, read back as kiln's `LinearPart`s and per-layer KV-cache ranges.

kiln does not use ModelOpt's exporter: the calibrated model's weights (smoothed by SmoothQuant or AWQ),
amax values and pre_quant_scales become kiln's own tensors in the format modules' `quantize`.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.distribution import install_hint

from .base import LinearPart, QuantError
from .calib_data import DEFAULT_CALIB_SIZE, CalibrationTexts, calibration_samples
from .spec import CalibrationRecord

logger = logging.getLogger("kiln.quant")

# ModelOpt's KV-cache quantizers sit on the keys and values the attention reads (after rotary).
_KV_QUANTIZER = "*[kv]_bmm_quantizer"
_KV_NUM_BITS = {"fp8": (4, 3), "int8": 8}
_CALIB_BATCH = 8  # samples per calibration forward pass


@dataclass
class CalibrationResult:
    state: dict[str, torch.Tensor]  # every parameter by checkpoint name, as calibration left it (CPU)
    linears: dict[str, LinearPart]  # by checkpoint module path
    kv_amax: list[tuple[float, float]] | None  # per layer (k, v), when the KV cache was calibrated
    record: CalibrationRecord
    modelopt_version: str


def import_modelopt():
    """ModelOpt's quantization package, or a QuantError saying how to install it."""
    try:
        import requests  # noqa: F401  (modelopt 0.47 imports it without declaring it)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "transformers X is not tested with modelopt": kiln's tests are
            import modelopt
            import modelopt.torch.quantization as mtq
    except ImportError as e:
        raise QuantError(f"calibration needs NVIDIA ModelOpt ({e}); install it (nvidia-modelopt and requests) with "
                         f"{install_hint('quant')}") from None
    return modelopt, mtq


def modelopt_config(format_config: Any | None, kv_cache_dtype: str) -> dict[str, Any]:
    """The format's ModelOpt config (a copy) with the KV-cache quantizers added when asked for."""
    base = format_config.modelopt_config() if format_config is not None else None
    cfg = copy.deepcopy(base) if base is not None else {"quant_cfg": [{"quantizer_name": "*", "enable": False}],
                                                        "algorithm": "max"}
    if kv_cache_dtype in _KV_NUM_BITS:
        cfg["quant_cfg"].append({"quantizer_name": _KV_QUANTIZER,
                                 "cfg": {"num_bits": _KV_NUM_BITS[kv_cache_dtype], "axis": None}})
    return cfg


def calibrate(checkpoint: Path, format_config: Any | None, kv_cache_dtype: str, data: CalibrationTexts,
              num_samples: int | None, max_seq_len: int, device: str = "cpu") -> CalibrationResult:
    """Runs ModelOpt's calibration of `checkpoint` for the format (None: the KV cache only) on `num_samples`
    samples (None, --calib-size not given: up to DEFAULT_CALIB_SIZE, as many as the data gives)."""
    modelopt, mtq = import_modelopt()
    import transformers

    start = time.perf_counter()
    dtype = torch.float32 if device == "cpu" else "auto"
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    except (OSError, ValueError) as e:
        raise QuantError(f"calibration cannot load {checkpoint} in transformers: {e}") from e
    samples = calibration_samples(data, tokenizer, num_samples or DEFAULT_CALIB_SIZE, max_seq_len)
    if not samples:
        raise QuantError(f"calibration data {data.name} gave no samples")
    _report_size(data, len(samples), max_seq_len, num_samples)

    def forward_loop(m: torch.nn.Module) -> None:
        # Logits only matter to calibration when lm_head itself is quantized (its input is calibrated either way,
        # by the last hidden states): otherwise one position's logits are kept instead of [B, T, vocab], the
        # largest tensor of the pass (most of the bundled model's calibration time).
        keep = {} if _quantizes_lm_head(m) else {"logits_to_keep": 1}
        with torch.no_grad():
            for batch in _batches(samples):
                m(input_ids=batch.to(device), **keep)

    cfg = modelopt_config(format_config, kv_cache_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, forward_loop)
    linears = _linear_parts(model)
    kv_amax = _kv_amax(model) if kv_cache_dtype in _KV_NUM_BITS else None
    state = {name: p.detach().float().cpu() for name, p in model.named_parameters()}
    seconds = time.perf_counter() - start
    record = CalibrationRecord(dataset=data.name, num_samples=len(samples), max_seq_len=max_seq_len,
                               num_tokens=sum(len(s) for s in samples), seconds=round(seconds, 2))
    logger.info("ModelOpt %s calibrated %d samples (%d tokens) in %.1fs", modelopt.__version__, record.num_samples,
                record.num_tokens, seconds)
    return CalibrationResult(state, linears, kv_amax, record, modelopt.__version__)


def _quantizes_lm_head(model: torch.nn.Module) -> bool:
    """Whether ModelOpt calibrates an lm_head quantizer of `model` (kiln excludes lm_head by default)."""
    head = getattr(model, "lm_head", None)
    return any(getattr(getattr(head, name, None), "is_enabled", False)
               for name in ("input_quantizer", "weight_quantizer", "output_quantizer"))


def _report_size(data: CalibrationTexts, size: int, max_seq_len: int, asked: int | None) -> None:
    """Fewer samples than a --calib-size the user gave is a warning; the default's upper bound not filled is not
    (kiln's own sample gives 159 windows of 512 tokens of kiln-tiny-code): the size is stated, at info level, as
    the build summary states it."""
    if asked is not None and size < asked:
        logger.warning("calibration data %s gives %d samples of up to %d tokens, fewer than --calib-size %d",
                       data.name, size, max_seq_len, asked)
    else:
        logger.info("calibrating on %d samples of up to %d tokens of %s%s", size, max_seq_len, data.name,
                    f" (all it gives; the default --calib-size takes up to {DEFAULT_CALIB_SIZE})"
                    if asked is None and size < DEFAULT_CALIB_SIZE else "")


def _batches(samples: list[list[int]]):
    """[B, L] batches of samples of one length (the windows of a text all have it), so no padding."""
    by_len: dict[int, list[list[int]]] = {}
    for s in samples:
        by_len.setdefault(len(s), []).append(s)
    for group in by_len.values():
        for i in range(0, len(group), _CALIB_BATCH):
            yield torch.tensor(group[i:i + _CALIB_BATCH], dtype=torch.long)


def _amax(quantizer) -> torch.Tensor | None:
    if quantizer is None or not quantizer.is_enabled or getattr(quantizer, "amax", None) is None:
        return None
    return quantizer.amax.detach().float().cpu()


def _linear_parts(model: torch.nn.Module) -> dict[str, LinearPart]:
    parts = {}
    for name, module in model.named_modules():
        weight_quantizer = getattr(module, "weight_quantizer", None)
        if weight_quantizer is None or not hasattr(module, "weight"):
            continue
        input_quantizer = getattr(module, "input_quantizer", None)
        pqs = getattr(input_quantizer, "pre_quant_scale", None)
        parts[name] = LinearPart(name=name, weight=module.weight.detach().float().cpu(),
                                 weight_amax=_amax(weight_quantizer), input_amax=_amax(input_quantizer),
                                 pre_quant_scale=None if pqs is None else pqs.detach().float().cpu().reshape(-1))
    return parts


def _kv_amax(model: torch.nn.Module) -> list[tuple[float, float]]:
    ranges = []
    for name, module in model.named_modules():
        k, v = _amax(getattr(module, "k_bmm_quantizer", None)), _amax(getattr(module, "v_bmm_quantizer", None))
        if k is not None and v is not None:
            ranges.append((name, float(k.max()), float(v.max())))
    if not ranges:
        raise QuantError("ModelOpt found no attention module to calibrate the KV cache on; this architecture's "
                         "attention is not one ModelOpt's KV-cache quantization knows")
    return [(k, v) for _, k, v in ranges]
