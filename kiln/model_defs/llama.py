"""Llama 2 / 3 / 3.1 / 3.2 and Mistral: the same decoder; Mistral adds a sliding window."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, parse_decoder_config, required
from .layers import DecoderForCausalLM
from .registry import ModelDef, register


def parse_llama(raw: dict[str, Any]) -> ModelConfig:
    bias = bool(raw.get("attention_bias", False))
    return parse_decoder_config(raw, qkv_bias=bias, o_bias=bias)


def parse_mistral(raw: dict[str, Any]) -> ModelConfig:
    window = raw.get("sliding_window") or 0
    return parse_decoder_config(raw, qkv_bias=False, o_bias=False,
                                layer_sliding_windows=(int(window),) * required(raw, "num_hidden_layers"))


register(ModelDef("LlamaForCausalLM", parse_llama, DecoderForCausalLM))
register(ModelDef("MistralForCausalLM", parse_mistral, DecoderForCausalLM))
