"""Mixture-of-experts architectures: Mixtral, Qwen2-MoE and Qwen3-MoE.

Each is its dense family's decoder with `layers/moe.py`'s MLP factory, a `MoEConfig` read from config.json
as transformers applies it, and recipes that stack the per-expert checkpoint tensors into the fused
[E, 2I, H] / [E, H, I] engine tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .config import ModelConfig, ModelConfigError, MoEConfig, parse_decoder_config, required
from .layers import DecoderForCausalLM
from .layers.moe import moe_mlp
from .qwen2 import qwen_layer_windows
from .recipes import Recipe, Stack, StackGroups, fused_recipe
from .registry import ModelDef, register

_EXPERTS = re.compile(r"(model\.layers\.\d+)\.mlp\.(experts\.gate_up\.weight|experts\.down\.weight|gate\.weight)")


def _moe(config: ModelConfig, **fields) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(config, moe=MoEConfig(**fields))


def parse_mixtral(raw: dict[str, Any]) -> ModelConfig:
    """Mixtral: every layer sparse, top-k of `num_local_experts` renormalized (softmax, top-k, divide by sum)."""
    layers = required(raw, "num_hidden_layers")
    window = int(raw.get("sliding_window") or 0)
    config = parse_decoder_config(raw, qkv_bias=False, o_bias=False, layer_sliding_windows=(window,) * layers)
    return _moe(config, num_experts=required(raw, "num_local_experts"), top_k=required(raw, "num_experts_per_tok"),
                intermediate_size=config.intermediate_size, renormalize=True, sparse_layers=(True,) * layers)


def qwen_sparse_layers(raw: dict[str, Any]) -> tuple[bool, ...]:
    """Which layers are sparse, as transformers' Qwen2-MoE / Qwen3-MoE decide: not in mlp_only_layers, and
    (index + 1) a multiple of decoder_sparse_step."""
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(required(raw, "num_hidden_layers")))


def _qwen_moe(raw: dict[str, Any], config: ModelConfig, shared: int) -> ModelConfig:
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if experts is None:
        raise ModelConfigError("config.json lacks the required field 'num_experts'")
    return _moe(config, num_experts=experts, top_k=required(raw, "num_experts_per_tok"),
                intermediate_size=required(raw, "moe_intermediate_size"),
                renormalize=bool(raw.get("norm_topk_prob", False)), sparse_layers=qwen_sparse_layers(raw),
                shared_expert_intermediate_size=shared)


def parse_qwen2_moe(raw: dict[str, Any]) -> ModelConfig:
    """Qwen2-MoE: Qwen2 attention (q/k/v biases), routed experts plus a sigmoid-gated shared expert."""
    config = parse_decoder_config(raw, qkv_bias=True, o_bias=False, layer_sliding_windows=qwen_layer_windows(raw))
    return _qwen_moe(raw, config, int(raw.get("shared_expert_intermediate_size") or 0))


def parse_qwen3_moe(raw: dict[str, Any]) -> ModelConfig:
    """Qwen3-MoE: Qwen3 attention (q/k norms), routed experts only."""
    bias = bool(raw.get("attention_bias", False))
    config = parse_decoder_config(raw, qkv_bias=bias, o_bias=bias, qk_norm=True,
                                  layer_sliding_windows=qwen_layer_windows(raw))
    return _qwen_moe(raw, config, 0)


def expert_recipes(block: str, gate: str, up: str, down: str):
    """Recipes for a family whose sparse block is `{layer}.{block}` in the checkpoint with experts
    `{block}.experts.{e}.{gate|up|down}.weight`; every other tensor as the dense family's."""

    def recipes(config: ModelConfig, engine_names: Iterable[str]) -> dict[str, Recipe]:
        out = {}
        for name in engine_names:
            m = _EXPERTS.fullmatch(name)
            if m is None:
                out[name] = fused_recipe(name)
                continue
            base, tensor = f"{m[1]}.{block}", m[2]
            experts = range(config.moe.num_experts)
            if tensor == "gate.weight":
                out[name] = Recipe((f"{base}.gate.weight",))
            elif tensor == "experts.gate_up.weight":
                parts = tuple(f"{base}.experts.{e}.{p}.weight" for e in experts for p in (gate, up))
                out[name] = Recipe(parts, StackGroups(2))
            else:
                out[name] = Recipe(tuple(f"{base}.experts.{e}.{down}.weight" for e in experts), Stack(0))
        return out

    return recipes


register(ModelDef("MixtralForCausalLM", parse_mixtral, DecoderForCausalLM, mlp=moe_mlp,
                  recipes=expert_recipes("block_sparse_moe", "w1", "w3", "w2")))
_QWEN_EXPERTS = expert_recipes("mlp", "gate_proj", "up_proj", "down_proj")
register(ModelDef("Qwen2MoeForCausalLM", parse_qwen2_moe, DecoderForCausalLM, mlp=moe_mlp, recipes=_QWEN_EXPERTS))
register(ModelDef("Qwen3MoeForCausalLM", parse_qwen3_moe, DecoderForCausalLM, mlp=moe_mlp, recipes=_QWEN_EXPERTS))
