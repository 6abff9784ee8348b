"""MXFP4 checkpoints (quantization_config.quant_method "mxfp4": OpenAI's GPT-OSS release), read by dequantizing.

Only the experts' weights are MXFP4 (`mlp.experts.{gate_up_proj,down_proj}_blocks` and `_scales`; the attention,
router, embeddings and head are BF16). GPT-OSS's recipes (model_defs/gpt_oss.py) dequantize them at build
(model_defs/mxfp4.py), so the engine is a plain float engine: this reader checks the checkpoint is one it can
build that way and returns no `CheckpointQuantization`. Keeping the experts MXFP4 in the engine (a dequantizing
GEMM) is not supported yet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.quant.base import QuantError

ARCHITECTURES = ("GptOssForCausalLM",)
_SUFFIXES = ("_blocks", "_scales")


def from_checkpoint(checkpoint: Path, quantization_config: dict[str, Any], hf_quant_config: dict[str, Any] | None,
                    names: set[str]) -> None:
    """None (a float engine: the model's recipes dequantize the MXFP4 tensors); QuantError for an MXFP4
    checkpoint kiln cannot build so, naming what it found."""
    config_path = checkpoint / "config.json"
    try:
        architectures = json.loads(config_path.read_text()).get("architectures") or []
    except (OSError, ValueError) as e:
        raise QuantError(f"cannot read {config_path}: {e}") from None
    if not set(architectures) & set(ARCHITECTURES):
        raise QuantError(f"{config_path}: quantization_config.quant_method='mxfp4' is read for "
                         f"{', '.join(ARCHITECTURES)}'s experts only, not for {architectures!r:.80}")
    for name in sorted(names):
        for suffix, other in zip(_SUFFIXES, _SUFFIXES[::-1]):
            if name.endswith(suffix) and name[:-len(suffix)] + other not in names:
                missing = name[:-len(suffix)] + other
                raise QuantError(f"checkpoint {checkpoint}: MXFP4 tensor {name} has no {missing}")
    if not any(name.endswith("_blocks") for name in names):
        raise QuantError(f"{config_path}: quantization_config.quant_method='mxfp4' but the checkpoint holds no "
                         f"MXFP4 tensors (*_blocks, *_scales)")
    return None
