"""Gemma 2 (transformers' modeling_gemma2.py): embeddings times sqrt(hidden_size) rounded to the embedding's dtype,
RMSNorms by (1 + weight) in float32, a norm before and after each sublayer, the gated GELU MLP (GeGLU), attention
scores and final logits soft-capped by tanh (`attn_logit_softcapping`, `final_logit_softcapping`), a sliding
window on the `layer_types` sliding_attention layers (every other layer, the first included, by default),
`query_pre_attn_scalar ** -0.5` as the score scale, head_dim apart from hidden / heads, tied embeddings.

The shared decoder with its layer options: `GemmaDecoderLayer` (the sandwich norms), `OffsetRMSNorm` as every
norm, `GeGLU` as the MLP, and ModelConfig's scalars (embedding_multiplier, attention_multiplier, the two
soft-caps). Gemma 3 (gemma3.py) is the same network with q/k norms and a rope of its own on local layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .config import ModelConfig, ModelConfigError, parse_decoder_config, required
from .layers import DecoderForCausalLM, ForwardContext, LinearFactory, MLPFactory
from .layers.attention import Attention
from .layers.decoder import NormFactory
from .layers.mlp import GatedMLP, GeGLU
from .layers.norm import OffsetRMSNorm
from .registry import ModelDef, register

LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma_layer_windows(raw: dict[str, Any], sliding_every: int) -> tuple[int, ...]:
    """Per layer: the sliding window on `layer_types`' sliding_attention layers, 0 on full_attention ones. Without
    layer_types, transformers makes every layer sliding except each `sliding_every`-th (Gemma 2: 2, Gemma 3: 6)."""
    num_layers = required(raw, "num_hidden_layers")
    types = raw.get("layer_types")
    if types is None:
        types = ["full_attention" if (i + 1) % sliding_every == 0 else "sliding_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ModelConfigError(f"layer_types must list {num_layers} of {', '.join(LAYER_TYPES)} (one per layer), "
                               f"got {types!r:.120}")
    window = raw.get("sliding_window")
    if "sliding_attention" in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelConfigError(f"sliding_window={window!r:.80} must be a positive integer: layer_types has "
                               f"sliding_attention layers")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _softcap(raw: dict[str, Any], key: str, default: float | None) -> float:
    # transformers' default when the key is absent; null (None) is off, which kiln writes 0.
    value = raw.get(key, default)
    return 0.0 if value is None else value


def parse_gemma(raw: dict[str, Any], *, sliding_every: int, qk_norm: bool, attn_softcap: float | None,
                final_softcap: float | None) -> ModelConfig:
    """The fields Gemma 2 and Gemma 3 share; the softcaps are transformers' defaults for absent keys (Gemma 3's
    attention takes none whatever its config says: `attn_softcap` None and its key ignored)."""
    arch = raw["architectures"][0]
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError(f"use_bidirectional_attention=true is not supported for {arch}: kiln's attention "
                               f"is causal")
    # transformers reads `hidden_activation` (older configs also carry a `hidden_act`); head_dim defaults to 256.
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    bias = bool(raw.get("attention_bias", False))
    config = parse_decoder_config({**raw, "hidden_act": act, "head_dim": raw.get("head_dim") or 256},
                                  qkv_bias=bias, o_bias=bias, qk_norm=qk_norm,
                                  layer_sliding_windows=gemma_layer_windows(raw, sliding_every),
                                  hidden_acts=("gelu_pytorch_tanh", "gelu"))
    scalar = required(raw, "query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not scalar > 0:
        raise ModelConfigError(f"query_pre_attn_scalar={scalar!r:.80} must be a number > 0")
    return dataclasses.replace(
        config,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        embedding_multiplier=config.hidden_size ** 0.5,
        attention_multiplier=scalar ** -0.5,  # transformers' scaling, the same float
        attn_logit_softcapping=0.0 if attn_softcap is None else _softcap(raw, "attn_logit_softcapping", attn_softcap),
        final_logit_softcapping=_softcap(raw, "final_logit_softcapping", final_softcap),
    )


def parse_gemma2(raw: dict[str, Any]) -> ModelConfig:
    return parse_gemma(raw, sliding_every=2, qk_norm=False, attn_softcap=50.0, final_softcap=30.0)


class GemmaDecoderLayer(nn.Module):
    """h = x + post_attention_layernorm(attn(input_layernorm(x))), then
    h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))). Names as the checkpoint's."""

    def __init__(self, config: ModelConfig, layer_index: int, linears: LinearFactory, mlp: MLPFactory,
                 prefix: str, norm: NormFactory) -> None:
        super().__init__()
        size, eps, dtype = config.hidden_size, config.rms_norm_eps, linears.dtype
        self.input_layernorm = norm(size, eps, dtype)
        self.self_attn = Attention(config, layer_index, linears, f"{prefix}.self_attn", norm)  # q/k norms: Gemma 3
        self.post_attention_layernorm = norm(size, eps, dtype)
        self.pre_feedforward_layernorm = norm(size, eps, dtype)
        self.mlp = mlp(config, layer_index, linears, f"{prefix}.mlp")
        self.post_feedforward_layernorm = norm(size, eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H], the previous layer's output being x + residual (the decoder's final norm adds them).
        hidden = x if residual is None else x + residual
        hidden = hidden + self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), ctx, cos, sin))
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden))), hidden


class Gemma2ForCausalLM(DecoderForCausalLM):
    layer_class = GemmaDecoderLayer
    norm_class = OffsetRMSNorm

    def __init__(self, config: ModelConfig, linears: LinearFactory | None = None,
                 mlp: MLPFactory = GatedMLP) -> None:
        super().__init__(config, linears, mlp)
        # transformers multiplies by sqrt(hidden_size) as a tensor of the embedding's dtype (48.0 stays 48.0,
        # sqrt(3072) = 55.43 becomes 55.5 in bfloat16): the same rounded number here (on the CPU: networks are
        # also built on the meta device).
        dtype = self.model.embed_tokens.weight.dtype
        self.embedding_multiplier = float(torch.tensor(config.embedding_multiplier, dtype=dtype, device="cpu"))


register(ModelDef("Gemma2ForCausalLM", parse_gemma2, Gemma2ForCausalLM, mlp=GeGLU))
