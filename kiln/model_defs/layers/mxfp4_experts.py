"""MoE experts kept in MXFP4 (GPT-OSS's release format, plugins/mxfp4.py): the stacked expert tensors the
MXFP4 MoE operator (plugins/mxfp4_moe.py) reads, in place of moe.py's float `ExpertWeight`.

Engine tensors of one stacked projection ([E, out, in] as a float weight would be):
    weight_blocks  [E, out, in / 32, 16] uint8   two E2M1 codes a byte, the low nibble first
    weight_scales  [E, out, in / 32] uint8       E8M0: a block of 32 inputs is times 2 ** (scale - 127)
    bias           [E, out] the engine dtype     (GPT-OSS)

Tensor parallelism cuts them as the float weight (FeatureShard): output rows anywhere, input features only on
whole blocks of 32, which the constructor checks, naming the tensor, its shape and tp_size.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.plugins.mxfp4 import BLOCK

from .parallel import FeatureShard


class Mxfp4ExpertWeight(nn.Module):
    """One stacked expert projection of whole shape [E, out, in] in MXFP4 (this rank's share: `shape`), with the
    FeatureShard the builder cuts it by; `row`: a down projection, whose bias rank 0 alone stores."""

    def __init__(self, name: str, shape: tuple[int, int, int], dtype: torch.dtype, shard: FeatureShard | None,
                 bias: bool = False, row: bool = False, tp_size: int = 1) -> None:
        super().__init__()
        experts, out, inputs = shape
        if inputs % BLOCK:
            whole = inputs * (tp_size if shard is not None and shard.dim == "input" else 1)
            tp = tp_size
            raise ValueError(
                f"{name}.weight_blocks [{experts}, {out}, {whole} / {BLOCK}, {BLOCK // 2}]: MXFP4 blocks hold {BLOCK} "
                f"input features each, and {inputs} of its {whole} input features (tp_size={tp}) are not a "
                f"multiple of {BLOCK}: a rank's share would cut a block; use a --tp-size for which {whole} / tp_size is a "
                f"multiple of {BLOCK}, or build with --dequantize (experts in the engine dtype)")
        groups = inputs // BLOCK
        self.weight_blocks = nn.Parameter(torch.empty((experts, out, groups, BLOCK // 2), dtype=torch.uint8),
                                          requires_grad=False)
        self.weight_scales = nn.Parameter(torch.empty((experts, out, groups), dtype=torch.uint8),
                                          requires_grad=False)
        self.bias = nn.Parameter(torch.empty((experts, out), dtype=dtype), requires_grad=False) if bias else None
        self.shard = shard
        self.parallel = "row" if row else None
