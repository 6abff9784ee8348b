"""The SwiGLU MLP with gate and up projections fused into one GEMM, its GELU twin GeGLU (Gemma), and the plain
GELU MLP (Starcoder2)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kiln.plugins import silu_and_mul, silu_and_mul_quant

from ..config import GELU_ACTS, ModelConfig, ModelConfigError
from .fp8_input import Fp8Input, fp8_consumer
from .linear import LinearFactory

# (config, layer index, linear factory, module prefix such as "model.layers.3.mlp") -> the layer's MLP block.
MLPFactory = Callable[[ModelConfig, int, LinearFactory, str], nn.Module]


class SwiGLU(nn.Module):
    """down_proj(silu(gate) * up) with [gate; up] = gate_up_proj(x). An FP8 down_proj gets its input quantized
    by the SiLU-and-mul kernel (fp8_input.py)."""

    def __init__(self, hidden: int, inter: int, bias: bool, linears: LinearFactory, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = linears.column(f"{prefix}.gate_up_proj", hidden, (inter, inter), bias)  # [gate; up]
        self.down_proj = linears.row(f"{prefix}.down_proj", inter, hidden, bias)
        self._down_fp8 = fp8_consumer(self.down_proj)

    def forward(self, x: torch.Tensor | Fp8Input) -> torch.Tensor:
        # x: [T, H] -> [T, 2I] -> [T, I] -> [T, H]
        gate_up = self.gate_up_proj(x)
        if self._down_fp8 is not None and self._down_fp8.takes_fp8:
            return self.down_proj(Fp8Input(*silu_and_mul_quant(gate_up, self._down_fp8.input_scale)))
        return self.down_proj(silu_and_mul(gate_up))


class GatedMLP(SwiGLU):
    """The default `ModelDef.mlp`: made from (config, layer index, linear factory, module prefix), like any
    other MLP block (an MoE block is one more such factory)."""

    def __init__(self, config: ModelConfig, layer_index: int, linears: LinearFactory, prefix: str) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, config.mlp_bias, linears, prefix)


class GeGLU(nn.Module):
    """down_proj(gelu(gate) * up) with [gate; up] = gate_up_proj(x) (Gemma), GELU exact or tanh-approximate as
    config.hidden_act says. torch's GELU: an FP8 down_proj quantizes its input itself."""

    def __init__(self, config: ModelConfig, layer_index: int, linears: LinearFactory, prefix: str) -> None:
        super().__init__()
        if config.hidden_act not in GELU_ACTS:
            raise ModelConfigError(f"hidden_act={config.hidden_act!r}: this MLP takes {', '.join(GELU_ACTS)}")
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"
        inter = config.intermediate_size
        self.gate_up_proj = linears.column(f"{prefix}.gate_up_proj", config.hidden_size, (inter, inter),
                                           config.mlp_bias)  # [gate; up], this rank's share of each
        self.down_proj = linears.row(f"{prefix}.down_proj", inter, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, 2I] -> [T, I] -> [T, H]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class GeluMLP(nn.Module):
    """c_proj(gelu(c_fc(x))), not gated (Starcoder2); GELU exact or tanh-approximate as config.hidden_act says.
    Biases as config.mlp_bias; the checkpoint's names (c_fc, c_proj) are kept."""

    def __init__(self, config: ModelConfig, layer_index: int, linears: LinearFactory, prefix: str) -> None:
        super().__init__()
        if config.hidden_act not in GELU_ACTS:
            raise ModelConfigError(f"hidden_act={config.hidden_act!r}: this MLP takes {', '.join(GELU_ACTS)}")
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"
        self.c_fc = linears.column(f"{prefix}.c_fc", config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.c_proj = linears.row(f"{prefix}.c_proj", config.intermediate_size, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, I] -> [T, H]
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))
