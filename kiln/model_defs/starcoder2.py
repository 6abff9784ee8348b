"""Starcoder2: LayerNorms with biases, biases on every projection (`use_bias`), a plain GELU MLP
(c_fc -> GELU -> c_proj), one sliding window on every layer, embeddings tied unless the config says not.

The shared decoder with two layer options: LayerNorm as its norm (`norm_class`) and `GeluMLP` as its MLP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import ModelConfig, parse_decoder_config, required
from .layers import DecoderForCausalLM
from .layers.mlp import GeluMLP
from .layers.norm import LayerNorm
from .registry import ModelDef, register


def parse_starcoder2(raw: dict[str, Any]) -> ModelConfig:
    # transformers' Starcoder2Config defaults: use_bias true, tied embeddings, norm_epsilon 1e-5, tanh GELU.
    bias = bool(raw.get("use_bias", True))
    window = int(raw.get("sliding_window") or 0)
    config = parse_decoder_config(raw, qkv_bias=bias, o_bias=bias, hidden_acts=("gelu_pytorch_tanh", "gelu"),
                                  layer_sliding_windows=(window,) * required(raw, "num_hidden_layers"))
    return dataclasses.replace(config, mlp_bias=bias, rms_norm_eps=float(required(raw, "norm_epsilon", 1e-5)),
                               tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))


class Starcoder2ForCausalLM(DecoderForCausalLM):
    norm_class = LayerNorm


register(ModelDef("Starcoder2ForCausalLM", parse_starcoder2, Starcoder2ForCausalLM, mlp=GeluMLP))
