"""Gemma 3's text model (`Gemma3ForCausalLM`, model_type gemma3_text; transformers' modeling_gemma3.py): Gemma 2's
network (gemma2.py) with q/k norms per head ((1 + weight) RMSNorms, before rotary), local (sliding_attention)
layers rotating by a rope of their own (`rope_local_base_freq`, unscaled) and global layers by `rope_theta` with
the rope scaling, every sixth layer global by default (`sliding_window_pattern`), no soft-capping of attention
scores (transformers' Gemma 3 attention ignores `attn_logit_softcapping`), the final logits' only when set.

One layer option beyond Gemma 2's: ModelConfig.sliding_rope, the local layers' rope. A multimodal checkpoint
(`Gemma3ForConditionalGeneration`) is refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import ModelConfig, ModelConfigError, RopeConfig, parse_rope
from .gemma2 import Gemma2ForCausalLM, parse_gemma
from .layers.mlp import GeGLU
from .registry import ModelDef, refuse, register

# transformers' Gemma3TextConfig.default_theta: the rope bases where a config names none.
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0


def gemma3_ropes(raw: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(global rope, local rope) from either layout: transformers 5's rope_parameters per layer type
    ({"full_attention": {...}, "sliding_attention": {...}}) or the older rope_theta + rope_scaling (global) and
    rope_local_base_freq (local)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        ropes = []
        for layer_type, theta in (("full_attention", GLOBAL_THETA), ("sliding_attention", LOCAL_THETA)):
            typed = params.get(layer_type) or {}
            if not isinstance(typed, dict):
                raise ModelConfigError(f"rope_parameters[{layer_type!r}]={typed!r:.80} must be an object")
            ropes.append(parse_rope({**raw, "rope_scaling": None,
                                     "rope_parameters": {"rope_type": "default", "rope_theta": theta, **typed}}))
        return ropes[0], ropes[1]
    if params is not None:
        raise ModelConfigError(f"rope_parameters={params!r:.80} must give full_attention and sliding_attention "
                               f"ropes for Gemma 3")
    global_rope = parse_rope({**raw, "rope_theta": raw.get("rope_theta") or GLOBAL_THETA})
    local_theta = raw.get("rope_local_base_freq") or LOCAL_THETA
    return global_rope, parse_rope({"rope_theta": local_theta})


def parse_gemma3(raw: dict[str, Any]) -> ModelConfig:
    # transformers writes the pattern it was given as _sliding_window_pattern; hub configs name it without "_".
    every = next((raw[k] for k in ("sliding_window_pattern", "_sliding_window_pattern") if raw.get(k) is not None), 6)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ModelConfigError(f"sliding_window_pattern={every!r:.80} must be an integer >= 1")
    global_rope, local_rope = gemma3_ropes(raw)
    config = parse_gemma({**raw, "rope_parameters": None, "rope_scaling": None}, sliding_every=every, qk_norm=True,
                         attn_softcap=None, final_softcap=None)
    return dataclasses.replace(config, rope=global_rope,
                               sliding_rope=None if local_rope == global_rope else local_rope)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's network; config.qk_norm gives each attention its (1 + weight) q/k norms, config.sliding_rope the
    local layers' rope."""


register(ModelDef("Gemma3ForCausalLM", parse_gemma3, Gemma3ForCausalLM, mlp=GeGLU))
refuse("Gemma3ForConditionalGeneration",
       "a multimodal Gemma 3 checkpoint (vision tower and text model under model.language_model); kiln runs Gemma 3 "
       "text checkpoints (Gemma3ForCausalLM) and does not support a multimodal checkpoint's text tower yet")
