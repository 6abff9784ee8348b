"""Granite: Llama with four scalars (transformers' modeling_granite.py): embeddings times
`embedding_multiplier`, each attention and MLP output times `residual_multiplier` before its residual add,
`attention_multiplier` as the attention score scale (not 1/sqrt(head_dim)), logits divided by `logits_scaling`.

The shared decoder reads the embedding, attention and logits scalars from ModelConfig; `GraniteDecoderLayer`
(the layer option) scales each sublayer's output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .config import ModelConfig, parse_decoder_config
from .layers import DecoderForCausalLM, ForwardContext
from .layers.decoder import DecoderLayer
from .registry import ModelDef, register


def parse_granite(raw: dict[str, Any]) -> ModelConfig:
    bias = bool(raw.get("attention_bias", False))
    config = parse_decoder_config(raw, qkv_bias=bias, o_bias=bias)
    # transformers' GraniteConfig defaults every multiplier to 1 (attention_multiplier too, not 1/sqrt(d)).
    scalars = {f: float(raw[f] if raw.get(f) is not None else 1.0)
               for f in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")}
    return dataclasses.replace(config, **scalars)


class GraniteDecoderLayer(DecoderLayer):
    """DecoderLayer with each sublayer's output times residual_multiplier before the (fused) residual add."""

    def __init__(self, config: ModelConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.residual_multiplier
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, ctx, cos, sin) * scale
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x) * scale, residual


class GraniteForCausalLM(DecoderForCausalLM):
    layer_class = GraniteDecoderLayer


register(ModelDef("GraniteForCausalLM", parse_granite, GraniteForCausalLM))
