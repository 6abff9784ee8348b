"""Norm modules: RMSNorm over the plugin operator, LayerNorm with a bias (Starcoder2), RMSNorm by (1 + weight)
(Gemma), and RMSNorm over a whole q or k projection that tensor parallelism splits over ranks (OLMo 2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.plugins import fused_add_rms_norm, fused_add_rms_norm_quant, rms_norm, rms_norm_quant

from .fp8_input import Fp8Consumer, Fp8Input, fp8_consumer
from .parallel import FeatureShard, TPComm, require_comm


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


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (Starcoder2), torch's own op: it runs on every device and matches
    transformers' nn.LayerNorm bit for bit. Same calls as RMSNorm; it hands linears float input (`feeds` is a
    no-op: an FP8 linear quantizes its input itself)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype))
        self.eps = eps

    def feeds(self, linear: nn.Module | None) -> None:
        """No fused FP8 output (see the class docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)  # [T, H]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual), as RMSNorm.add_and_norm."""
        residual = x + residual
        return self.forward(residual), residual


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight) (Gemma 2 and 3: the checkpoint stores the offset from 1), computed in
    float32 and cast back once, as transformers' Gemma2RMSNorm (Llama's RMSNorm casts before the weight).
    torch's own ops; same calls as RMSNorm, `feeds` a no-op as LayerNorm's (an FP8 linear quantizes its input
    itself)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype))
        self.eps = eps

    def feeds(self, linear: nn.Module | None) -> None:
        """No fused FP8 output (see the class docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., size] (hidden states, or q / k heads) -> same shape and dtype
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual), as RMSNorm.add_and_norm."""
        residual = x + residual
        return self.forward(residual), residual


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection, all heads together (OLMo 2), not per head.

    With tensor parallelism a rank holds `shard`'s heads: its weight is their slice (the builder cuts it by
    `shard`), and the mean square is its sum of squares all-reduced over the ranks, divided by tp_size times
    its own width. That is the whole projection's mean also where KV heads are replicated, since each head
    is then held by the same number of ranks."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, shard: FeatureShard | None = None,
                 comm: TPComm | None = None) -> None:
        super().__init__()
        self.shard = shard
        self.comm = comm
        self.weight = nn.Parameter(torch.ones(shard.local_sizes[0] if shard else size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, local width] (a view of the fused qkv output; last dim contiguous) -> [T, local width]
        if self.shard is None:
            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        square_sum = require_comm(self.comm, "q/k norm").all_reduce(xf.pow(2).sum(-1, keepdim=True))  # [T, 1]
        tp = require_comm(self.comm, "q/k norm").tp_size
        inv_rms = (square_sum / (tp * x.shape[-1])).add_(self.eps).rsqrt_()
        return (xf * inv_rms).to(x.dtype).mul_(self.weight)
