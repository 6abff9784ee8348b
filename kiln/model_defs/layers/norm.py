"""RMSNorm module over the plugin operator."""

from __future__ import annotations

import torch
from torch import nn

from kiln.plugins import fused_add_rms_norm, fused_add_rms_norm_quant, rms_norm, rms_norm_quant

from .fp8_input import Fp8Consumer, Fp8Input, fp8_consumer


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps
        self._fp8: Fp8Consumer | None = None

    def feeds(self, linear: nn.Module | None) -> None:
        """Names the linear this norm's output goes to: an FP8 linear then gets its input in FP8 from the norm
        kernel (an Fp8Input) instead of quantizing it itself."""
        self._fp8 = fp8_consumer(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor | Fp8Input:
        if self._fp8 is not None and self._fp8.takes_fp8:
            return Fp8Input(*rms_norm_quant(x, self.weight, self.eps, self._fp8.input_scale))
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor | Fp8Input, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): one fused kernel instead of two passes."""
        if self._fp8 is not None and self._fp8.takes_fp8:
            x_q, x_scale, residual = fused_add_rms_norm_quant(x, residual, self.weight, self.eps,
                                                              self._fp8.input_scale)
            return Fp8Input(x_q, x_scale), residual
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
