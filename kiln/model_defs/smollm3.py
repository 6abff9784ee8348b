"""SmolLM3: Llama whose NoPE layers skip rotary (`no_rope_layers[i] == 0`; transformers derives the list from
`no_rope_layer_interval`: every interval-th layer is NoPE), with optional sliding windows on layers whose
`layer_types` says sliding_attention (transformers puts them on NoPE layers when `use_sliding_window`), biases
per `attention_bias` (q, k, v and o) and `mlp_bias`, embeddings tied unless the config says not.

The shared decoder with one layer option: `SmolLM3DecoderLayer` passes an identity rotation on NoPE layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .config import ModelConfig, ModelConfigError, parse_decoder_config, required
from .layers import DecoderForCausalLM, ForwardContext
from .layers.decoder import DecoderLayer
from .registry import ModelDef, register


def _rope_flags(raw: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = raw.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ModelConfigError(f"no_rope_layer_interval={interval!r:.80} must be an integer >= 1")
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(flags, list) or len(flags) != num_layers:
        raise ModelConfigError(f"no_rope_layers must be a list of {num_layers} flags (one per layer), "
                               f"got {flags!r:.80}")
    return tuple(bool(f) for f in flags)


def parse_smollm3(raw: dict[str, Any]) -> ModelConfig:
    num_layers = required(raw, "num_hidden_layers")
    rope = _rope_flags(raw, num_layers)
    window = int(raw.get("sliding_window") or 0) if raw.get("use_sliding_window", False) else 0
    layer_types = raw.get("layer_types") or ["sliding_attention" if window and not r else "full_attention"
                                             for r in rope]
    bias = bool(raw.get("attention_bias", False))
    config = parse_decoder_config(raw, qkv_bias=bias, o_bias=bias,
                                  layer_sliding_windows=tuple(window if t == "sliding_attention" else 0
                                                              for t in layer_types))
    return dataclasses.replace(config, layer_rope=rope, tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))


class SmolLM3DecoderLayer(DecoderLayer):
    """DecoderLayer whose NoPE layers rotate by angle 0 (cos 1, sin 0): keys are cached unrotated."""

    def __init__(self, config: ModelConfig, layer_index: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, layer_index, *args, **kwargs)
        self.use_rope = config.layer_rope[layer_index]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.use_rope:
            cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
        return super().forward(x, residual, ctx, cos, sin)


class SmolLM3ForCausalLM(DecoderForCausalLM):
    layer_class = SmolLM3DecoderLayer


register(ModelDef("SmolLM3ForCausalLM", parse_smollm3, SmolLM3ForCausalLM))
