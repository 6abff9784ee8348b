"""The SwiGLU MLP with gate and up projections fused into one GEMM."""

from __future__ import annotations

import torch
from torch import nn

from kiln.plugins import silu_and_mul


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)  # [gate; up] rows
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, 2I] -> [T, I] -> [T, H]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
