"""Which pre-quantized format a checkpoint is in, from config.json's `quantization_config` and ModelOpt's
`hf_quant_config.json`; a checkpoint kiln cannot read exactly is refused here, before anything is written.

A checkpoint with quantized-looking tensors (weight_scale, qweight, weight_packed, ...) but no config saying
what they are is refused too: building it as if it were plain would cast codes and drop scales.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kiln.checkpoints.prequant.base import CheckpointQuantization
from kiln.quant.base import QuantError

# quant_method -> the module whose `from_checkpoint(checkpoint, quantization_config, hf_quant_config, names)`
# reads that format.
READERS = {
    "modelopt": "kiln.checkpoints.prequant.modelopt",
    "compressed-tensors": "kiln.checkpoints.prequant.compressed_tensors",
    "fp8": "kiln.checkpoints.prequant.fp8_block",
    "awq": "kiln.checkpoints.prequant.awq",
    "gptq": "kiln.checkpoints.prequant.gptq",
    # GPT-OSS's MXFP4 experts, kept MXFP4 (scheme mxfp4) or dequantized by the model's recipes (--dequantize).
    "mxfp4": "kiln.checkpoints.prequant.mxfp4",
}
HF_QUANT_CONFIG = "hf_quant_config.json"
# Last name components of tensors that only quantized checkpoints have.
QUANTIZED_TENSOR_NAMES = frozenset({
    "weight_scale", "weight_scale_inv", "input_scale", "weight_packed", "weight_zero_point", "weight_shape",
    "qweight", "qzeros", "scales", "g_idx", "pre_quant_scale", "k_scale", "v_scale", "kv_scale",
    "weight_global_scale", "input_global_scale",
})


def detect_checkpoint_quantization(checkpoint: Path, raw_config: dict[str, Any],
                                   names: Iterable[str]) -> CheckpointQuantization | None:
    """The checkpoint's format reader, None for a plain checkpoint; QuantError (naming the file, field and
    value, and what kiln reads) for one kiln cannot read exactly."""
    names = set(names)
    config = raw_config.get("quantization_config")
    hf_path = checkpoint / HF_QUANT_CONFIG
    hf_config = _read_json(hf_path) if hf_path.is_file() else None
    if config is None and hf_config is None:
        quantized = sorted(n for n in names if n.rsplit(".", 1)[-1] in QUANTIZED_TENSOR_NAMES)
        if quantized:
            raise QuantError(
                f"checkpoint {checkpoint} holds quantized tensors ({', '.join(quantized[:3])}"
                f"{' and more' if len(quantized) > 3 else ''}) but neither config.json's quantization_config nor "
                f"{HF_QUANT_CONFIG} says their format; kiln will not build it as if it were unquantized")
        return None
    if config is not None and not isinstance(config, dict):
        raise QuantError(f"{checkpoint / 'config.json'}: quantization_config must be an object, got {config!r:.80}")
    method = (config or {}).get("quant_method", "modelopt" if hf_config is not None else None)
    if method not in READERS:
        raise QuantError(f"{checkpoint / 'config.json'}: quantization_config.quant_method={method!r} is not a "
                         f"format kiln reads; kiln reads pre-quantized checkpoints of: {', '.join(READERS)}")
    reader = importlib.import_module(READERS[method])
    return reader.from_checkpoint(checkpoint, config or {}, hf_config, names)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise QuantError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise QuantError(f"{path} must hold a JSON object")
    return data
