"""Qwen3 (dense): Llama with RMSNorm on each query and key head before rotary."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, parse_decoder_config
from .layers import DecoderForCausalLM
from .qwen2 import qwen_layer_windows
from .registry import ModelDef, register


def parse_qwen3(raw: dict[str, Any]) -> ModelConfig:
    bias = bool(raw.get("attention_bias", False))
    return parse_decoder_config(raw, qkv_bias=bias, o_bias=bias, qk_norm=True,
                                layer_sliding_windows=qwen_layer_windows(raw))


register(ModelDef("Qwen3ForCausalLM", parse_qwen3, DecoderForCausalLM))
