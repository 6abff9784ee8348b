"""MXFP4 checkpoints (quantization_config.quant_method "mxfp4": OpenAI's GPT-OSS release).

Only the experts' weights are MXFP4 (`mlp.experts.{gate_up_proj,down_proj}_blocks` and `_scales`; the attention,
router, embeddings and head are BF16). By default the engine keeps them MXFP4 (scheme `mxfp4`, kiln.quant.mxfp4):
no linear layer is quantized, and GPT-OSS's recipes (model_defs/gpt_oss.py) copy the blocks and scales into the
experts' engine tensors, so `layer_tensors` is never asked for a layer. `kiln build --dequantize` builds a float
engine instead (the recipes dequantize: `dequantizable`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kiln.model_defs.layers.linear import Linear
from kiln.quant.base import QuantError
from kiln.quant.spec import QuantSpec

from .base import CheckpointQuantization, ReadTensor

ARCHITECTURES = ("GptOssForCausalLM",)
_SUFFIXES = ("_blocks", "_scales")


class Mxfp4Checkpoint(CheckpointQuantization):
    """GPT-OSS's MXFP4 experts, kept in the engine as they are."""

    name = "MXFP4 experts (config.json quantization_config)"
    dequantizable = True  # `kiln build --dequantize`: the model's recipes make float experts instead

    def quant_spec(self) -> QuantSpec:
        return QuantSpec(qformat="mxfp4", kv_cache_dtype="auto", source=self.name)

    def layer_tensors(self, prefix: str, layer: Linear, modules: Sequence[str],
                      read: ReadTensor) -> dict[str, torch.Tensor]:
        raise QuantError(f"{prefix}: an MXFP4 checkpoint quantizes no linear layer (only the MoE experts, which "
                         f"the model's recipes read)")

    def module_tensors(self, module: str) -> tuple[str, ...]:
        return ()


def from_checkpoint(checkpoint: Path, quantization_config: dict[str, Any], hf_quant_config: dict[str, Any] | None,
                    names: set[str]) -> Mxfp4Checkpoint:
    """The format (experts kept MXFP4; --dequantize makes a float engine of it); QuantError for an MXFP4
    checkpoint kiln cannot build, naming what it found."""
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
    return Mxfp4Checkpoint()
