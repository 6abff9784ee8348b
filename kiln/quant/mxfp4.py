"""`mxfp4`: the MoE experts' weights kept in MXFP4 (pre-quantized checkpoints only: GPT-OSS's release).

The checkpoint's experts (`mlp.experts.{gate_up_proj,down_proj}_blocks` and `_scales`: E2M1 blocks of 32 with an
E8M0 scale, plugins/mxfp4.py) go into the engine as they are, 4.25 bits a weight; every linear layer (attention,
router, embeddings, head) stays in the engine dtype, as the checkpoint ships them. The config quantizes no
linear: its `moe_experts` tells the MoE block (model_defs/layers/moe.py) to declare its experts as MXFP4 blocks
and scales and to run them through plugins/mxfp4_moe.py. `kiln build --dequantize` builds the same checkpoint
into a float engine instead (no scheme recorded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .registry import QuantScheme, register
from .selection import LayerSelection


@dataclass(frozen=True)
class Mxfp4ExpertsConfig:
    """Quantizes no linear layer; the MoE experts are MXFP4 (`moe_experts`)."""

    selection: LayerSelection = field(default_factory=LayerSelection)
    moe_experts: str = "mxfp4"  # read by model_defs/layers/moe.py's SparseMoE

    def linear_method(self, prefix: str, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        return None  # linears stay in the engine dtype

    def modelopt_config(self) -> None:
        return None  # read from checkpoints, never calibrated


register(QuantScheme("mxfp4", lambda p: Mxfp4ExpertsConfig(p.selection), order=10, buildable=False))
