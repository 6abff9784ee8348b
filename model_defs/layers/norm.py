"""RMSNorm module over the plugin operator."""

from __future__ import annotations

import torch
from torch import nn

from kiln.plugins import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): one fused kernel instead of two passes."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
