"""OLMo 2: post-norms (each sublayer's output is normalized before the residual add; no norm before attention
or the MLP) and q/k RMSNorm over the whole q and k projections, not per head.

The shared decoder with two layer options: `Olmo2DecoderLayer` (the post-norm order, on the shared attention
and MLP) and `qk_norm_scope="projection"` (attention's q/k norms, split over tensor-parallel ranks by head).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .config import ModelConfig, parse_decoder_config
from .layers import DecoderForCausalLM, ForwardContext, LinearFactory, MLPFactory
from .layers.attention import Attention
from .layers.decoder import NormFactory
from .registry import ModelDef, register


def parse_olmo2(raw: dict[str, Any]) -> ModelConfig:
    bias = bool(raw.get("attention_bias", False))
    config = parse_decoder_config(raw, qkv_bias=bias, o_bias=bias, qk_norm=True)
    return dataclasses.replace(config, qk_norm_scope="projection")


class Olmo2DecoderLayer(nn.Module):
    """h + post_feedforward_layernorm(mlp(h)) with h = x + post_attention_layernorm(attn(x)). Names as the
    checkpoint's (post_attention_layernorm is a post-norm here, not Llama's pre-MLP norm)."""

    def __init__(self, config: ModelConfig, layer_index: int, linears: LinearFactory, mlp: MLPFactory,
                 prefix: str, norm: NormFactory) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index, linears, f"{prefix}.self_attn")
        self.mlp = mlp(config, layer_index, linears, f"{prefix}.mlp")
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps, linears.dtype)
        self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps, linears.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H], the previous layer's output being x + residual (the decoder's final norm adds them).
        hidden = x if residual is None else x + residual
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, ctx, cos, sin))
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class Olmo2ForCausalLM(DecoderForCausalLM):
    layer_class = Olmo2DecoderLayer


register(ModelDef("Olmo2ForCausalLM", parse_olmo2, Olmo2ForCausalLM))
