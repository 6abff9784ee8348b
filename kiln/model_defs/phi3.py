"""Phi-3 / 3.5 / 4-mini (`Phi3ForCausalLM`): Llama with the checkpoint's q/k/v and gate/up projections already
fused (`qkv_proj` = [q; k; v] rows, `gate_up_proj` = [gate; up] rows: kiln's own fused layouts), LongRoPE
(`rope_scaling` type "longrope", Phi-3's older "su", and "yarn", which transformers' Phi3Config reads as
longrope too), partial rotary (`partial_rotary_factor`, Phi-4-mini 0.75), one sliding window on every layer
where the config has one (Phi-3-mini-4k: 2047), embeddings tied only where the config says so (Phi-4-mini).

The shared decoder as is: rope_params.py reads the rope settings, layers/rotary.py makes the tables. The
recipes copy each tensor by name; tensor parallelism cuts the fused tensors per rank by their q, k, v (gate,
up) parts as it cuts any fused tensor (builder/sharding.py), so the shards are the same as from a split
checkpoint's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from .config import ModelConfig, ModelConfigError, parse_decoder_config, parse_rope, required
from .layers import DecoderForCausalLM
from .recipes import Recipe
from .registry import ModelDef, register
from .rope_params import check_partial_rotary_factor

# transformers' Phi3Config defaults where they differ from parse_decoder_config's.
_PHI3_DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096}


def parse_phi3(raw: dict[str, Any]) -> ModelConfig:
    raw = {**_PHI3_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    rope_key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    rope = dict(raw.get(rope_key) or {})
    partial = check_partial_rotary_factor(rope.pop("partial_rotary_factor", raw.pop("partial_rotary_factor", 1.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("su", "yarn"):  # Phi3Config: "for backward compatibility", both are longrope
        rope["rope_type"] = "longrope"
        rope.pop("type", None)
    elif rope_type not in ("default", "longrope"):
        raise ModelConfigError(f"rope_scaling type {rope_type!r} is not supported for Phi3ForCausalLM; supported: "
                               f"default, longrope (su)")
    rope_config = dataclasses.replace(parse_rope({**raw, rope_key: rope}), partial_rotary_factor=partial)
    window = raw.get("sliding_window") or 0
    # The decoder's fields without the rope, whose factors are checked against the rotated dims, which
    # partial_rotary_factor decides; replace() checks the whole config again.
    config = parse_decoder_config({**raw, "rope_parameters": None, "rope_scaling": None}, qkv_bias=False,
                                  o_bias=False,
                                  layer_sliding_windows=(int(window),) * required(raw, "num_hidden_layers"))
    return dataclasses.replace(config, rope=rope_config)


def phi3_recipes(config: ModelConfig, engine_names: Iterable[str]) -> dict[str, Recipe]:
    """Every engine tensor is the checkpoint tensor of its name: the checkpoint fuses qkv_proj and
    gate_up_proj in kiln's row order already."""
    return {name: Recipe((name,)) for name in engine_names}


register(ModelDef("Phi3ForCausalLM", parse_phi3, DecoderForCausalLM, recipes=phi3_recipes))
