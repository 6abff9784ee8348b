"""The SwiGLU MLP with gate and up projections fused into one GEMM."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kiln.plugins import silu_and_mul

from ..config import ModelConfig
from .linear import LinearFactory

# (config, layer index, linear factory, module prefix such as "model.layers.3.mlp") -> the layer's MLP block.
MLPFactory = Callable[[ModelConfig, int, LinearFactory, str], nn.Module]


class GatedMLP(nn.Module):
    """The default `ModelDef.mlp`: made from (config, layer index, linear factory, module prefix), like any
    other MLP block (an MoE block is one more such factory)."""

    def __init__(self, config: ModelConfig, layer_index: int, linears: LinearFactory, prefix: str) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = linears.column(f"{prefix}.gate_up_proj", hidden, (inter, inter), bias)  # [gate; up]
        self.down_proj = linears.row(f"{prefix}.down_proj", inter, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, 2I] -> [T, I] -> [T, H]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
