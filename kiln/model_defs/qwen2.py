"""Qwen2 / Qwen2.5: Llama with biases on q, k and v (not o), and optional sliding windows on upper layers."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, parse_decoder_config, required
from .layers import DecoderForCausalLM
from .registry import ModelDef, register


def qwen_layer_windows(raw: dict[str, Any]) -> tuple[int, ...]:
    """Per-layer windows as transformers derives them: `layer_types` if given, else sliding attention on
    layers >= max_window_layers when use_sliding_window is set."""
    num_layers = required(raw, "num_hidden_layers")
    window = int(raw.get("sliding_window") or 0) if raw.get("use_sliding_window", False) else 0
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = raw.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if window and i >= first else "full_attention" for i in range(num_layers)]
    return tuple(window if t == "sliding_attention" else 0 for t in layer_types)


def parse_qwen2(raw: dict[str, Any]) -> ModelConfig:
    return parse_decoder_config(raw, qkv_bias=True, o_bias=False, layer_sliding_windows=qwen_layer_windows(raw))


register(ModelDef("Qwen2ForCausalLM", parse_qwen2, DecoderForCausalLM))
