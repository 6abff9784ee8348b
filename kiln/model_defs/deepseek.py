"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (layers/mla.py) and DeepSeek-MoE
(layers/deepseek_moe.py: shared experts, fine-grained routed experts, grouped routing), the first
`first_k_dense_replace` layers dense.

The config keeps head_dim = qk_rope_head_dim (the rotary tables' width, as transformers sets it) and
num_kv_heads = num_heads; `ModelConfig.mla` holds the latent sizes, from which the KV cache is sized
(mla_config.kv_cache_layout: kv_lora_rank + qk_rope_head_dim values per token and layer).

V3's multi-token-prediction layers (`num_nextn_predict_layers`, checkpoint layers past num_hidden_layers) are
not part of the network: their tensors are left unread (the builder lists them as unused).

A block-scaled FP8 checkpoint (quant_method "fp8" with weight_block_size, V3's release) builds an `fp8_block`
engine: q_a_proj / q_b_proj (or q_proj), kv_a_proj_with_mqa, o_proj, the dense MLPs and the shared experts stay
FP8; kv_b_proj (absorbed into the query and output) and the routed experts are dequantized at build.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .config import ModelConfig, ModelConfigError, MoEConfig, parse_decoder_config, required
from .fp8_block import DequantizeFp8Block, with_scales
from .layers import DecoderForCausalLM, LinearFactory, MLPFactory
from .layers.decoder import DecoderLayer, NormFactory
from .layers.deepseek_moe import deepseek_mlp
from .layers.mla import MLAttention
from .mla_config import GroupedRouting, MLAConfig
from .moe import expert_recipes
from .recipes import Recipe
from .registry import ModelDef, register


def _parse_deepseek(raw: dict[str, Any], routing: GroupedRouting) -> ModelConfig:
    heads = required(raw, "num_attention_heads")
    rope_dim = required(raw, "qk_rope_head_dim")
    fp8_block = _fp8_block_size(raw)
    # head_dim is the rope part (rotary tables); every head has its own k and v (num_kv_heads = num_heads)
    config = parse_decoder_config({**raw, "head_dim": rope_dim, "num_key_value_heads": heads,
                                   "mlp_bias": False}, qkv_bias=False,
                                  o_bias=bool(raw.get("attention_bias", False)))
    mla = MLAConfig(q_lora_rank=raw.get("q_lora_rank") or 0, kv_lora_rank=required(raw, "kv_lora_rank"),
                    qk_nope_head_dim=required(raw, "qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
                    v_head_dim=required(raw, "v_head_dim"),
                    rope_interleave=bool(raw.get("rope_interleave", True)), fp8_block_size=fp8_block)
    layers = config.num_layers
    dense = raw.get("first_k_dense_replace") or 0
    experts = raw.get("n_routed_experts")
    if not experts:  # no routed experts: every layer dense
        return dataclasses.replace(config, mla=mla)
    step = int(raw.get("moe_layer_freq", 1) or 1)
    sparse = tuple(i >= dense and i % step == 0 for i in range(layers))
    inter = required(raw, "moe_intermediate_size")
    moe = MoEConfig(num_experts=experts, top_k=required(raw, "num_experts_per_tok"), intermediate_size=inter,
                    renormalize=False, sparse_layers=sparse,
                    shared_expert_intermediate_size=inter * int(raw.get("n_shared_experts") or 0), routing=routing)
    return dataclasses.replace(config, mla=mla, moe=moe)


def _fp8_block_size(raw: dict[str, Any]) -> tuple[int, int] | None:
    """The checkpoint's FP8 weight_block_size (None for a float checkpoint); ModelConfigError for any other
    pre-quantized format. The rest of quantization_config is checked by checkpoints/prequant/fp8_block.py."""
    config = raw.get("quantization_config")
    if config is None:
        return None
    method = config.get("quant_method", "?") if isinstance(config, dict) else "?"
    block = config.get("weight_block_size") if isinstance(config, dict) else None
    if method != "fp8" or block is None:
        what = f"{method}, no weight_block_size" if method == "fp8" else method
        raise ModelConfigError(f"{raw['architectures'][0]}: pre-quantized checkpoints ({what}) are not supported "
                               f"with MLA; supported: block-scaled FP8 (quant_method fp8 with weight_block_size, "
                               f"DeepSeek-V3's release format), or convert to BF16 first")
    if not isinstance(block, list | tuple) or len(block) != 2 or any(type(b) is not int or b <= 0 for b in block):
        raise ModelConfigError(f"quantization_config.weight_block_size={block!r:.80} must be two positive integers "
                               f"[rows, columns]")
    return block[0], block[1]


def _group_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(n_group=raw.get("n_group") or 1, topk_group=raw.get("topk_group") or 1,
                routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)))


def parse_deepseek_v2(raw: dict[str, Any]) -> ModelConfig:
    """DeepSeek-V2 (and V2-Lite, q_lora_rank null): softmax router scores, greedy or group-limited top-k."""
    scoring = raw.get("scoring_func") or "softmax"
    if scoring != "softmax":
        raise ModelConfigError(f"DeepseekV2ForCausalLM: scoring_func={scoring!r} is not supported; supported: softmax")
    routing = GroupedRouting(scoring="softmax", topk_method=raw.get("topk_method") or "greedy", **_group_fields(raw))
    if routing.topk_method == "noaux_tc":
        raise ModelConfigError("DeepseekV2ForCausalLM: topk_method='noaux_tc' is V3's; supported: greedy, "
                               "group_limited_greedy")
    # transformers' V2 rotates interleaved pairs always (its complex rotation); rope_interleave is V3's switch
    return _parse_deepseek({**raw, "rope_interleave": True}, routing)


def parse_deepseek_v3(raw: dict[str, Any]) -> ModelConfig:
    """DeepSeek-V3 (and R1): sigmoid router scores with e_score_correction_bias, groups ranked by their two best
    experts (noaux_tc), weights normalized then scaled."""
    scoring = raw.get("scoring_func") or "sigmoid"
    method = raw.get("topk_method") or "noaux_tc"
    if scoring != "sigmoid" or method != "noaux_tc":
        raise ModelConfigError(f"DeepseekV3ForCausalLM: scoring_func={scoring!r}, topk_method={method!r} are not "
                               f"supported; supported: sigmoid with noaux_tc")
    return _parse_deepseek(raw, GroupedRouting(scoring="sigmoid", topk_method="noaux_tc", **_group_fields(raw)))


class DeepseekDecoderLayer(DecoderLayer):
    """The shared pre-norm layer (its forward) with MLA in place of the fused-QKV attention."""

    def __init__(self, config: ModelConfig, layer_index: int, linears: LinearFactory, mlp: MLPFactory,
                 prefix: str, norm: NormFactory) -> None:
        nn.Module.__init__(self)  # DecoderLayer's own __init__ would make the fused-QKV attention
        eps, dtype = config.rms_norm_eps, linears.dtype
        self.input_layernorm = norm(config.hidden_size, eps, dtype)
        self.self_attn = MLAttention(config, layer_index, linears, f"{prefix}.self_attn")
        self.post_attention_layernorm = norm(config.hidden_size, eps, dtype)
        self.mlp = mlp(config, layer_index, linears, f"{prefix}.mlp")
        self.post_attention_layernorm.feeds(getattr(self.mlp, "gate_up_proj", None))


class DeepseekForCausalLM(DecoderForCausalLM):
    layer_class = DeepseekDecoderLayer


_EXPERTS = expert_recipes("mlp", "gate_proj", "up_proj", "down_proj")
_ROPE_ROWS = re.compile(r".*\.self_attn\.(q_proj|q_b_proj|kv_a_proj_with_mqa)\.(weight|bias)")
# Kept in float from a block-scaled FP8 checkpoint: dequantized at build.
_DEQUANTIZED = re.compile(r".*\.(self_attn\.kv_b_proj|mlp\.experts\.gate_up|mlp\.experts\.down)\.weight")


def _halves_rows(config: ModelConfig):
    """The part transform that reorders each rope part's rows from DeepSeek's interleaved pairs to halves
    (evens, then odds: rotate_half's layout), so the engine rotates with the shared rotary op. Queries (per head:
    its last qk_rope_head_dim rows) and the shared key (kv_a_proj_with_mqa's last rows) alike: their dots keep
    their values."""
    mla = config.mla
    order = torch.cat([torch.arange(0, mla.qk_rope_head_dim, 2), torch.arange(1, mla.qk_rope_head_dim, 2)])

    def transform(engine_name: str, part: str, t: torch.Tensor) -> torch.Tensor:
        if ".kv_a_proj_with_mqa." in engine_name:  # rows [c (kv_lora_rank); k_pe (rope)]
            return torch.cat([t[:mla.kv_lora_rank], t[mla.kv_lora_rank:][order]])
        heads = t.view(config.num_heads, mla.qk_head_dim, *t.shape[1:])  # rows [q_nope; q_pe] per head
        return torch.cat([heads[:, :mla.qk_nope_head_dim], heads[:, mla.qk_nope_head_dim:][:, order]],
                         dim=1).reshape(t.shape)

    return transform


def deepseek_recipes(config: ModelConfig, engine_names: Iterable[str]) -> dict[str, Recipe]:
    """Experts stacked (moe.py's recipes), everything else by name; with `rope_interleave` (DeepSeek's layout)
    the rope rows of q and kv_a_proj_with_mqa reordered to halves at build (in a block-scaled FP8 checkpoint
    within their row blocks: builder/quantize.py applies the same order to the FP8 rows). From a block-scaled FP8
    checkpoint kv_b_proj and the routed experts are dequantized (fp8_block.py): the engine keeps them in float."""
    names = list(engine_names)
    recipes = _EXPERTS(config, names)
    if config.mla is not None and config.mla.rope_interleave:
        transform = _halves_rows(config)
        for name in names:
            if _ROPE_ROWS.fullmatch(name):
                recipes[name] = Recipe((name,), transform=transform)
    block = None if config.mla is None else config.mla.fp8_block_size
    if block is not None:
        for name in names:
            if _DEQUANTIZED.fullmatch(name):
                recipe = recipes[name]
                recipes[name] = Recipe(with_scales(recipe.parts), DequantizeFp8Block(block, recipe.combine))
    return recipes


register(ModelDef("DeepseekV2ForCausalLM", parse_deepseek_v2, DeepseekForCausalLM, mlp=deepseek_mlp,
                  recipes=deepseek_recipes))
register(ModelDef("DeepseekV3ForCausalLM", parse_deepseek_v3, DeepseekForCausalLM, mlp=deepseek_mlp,
                  recipes=deepseek_recipes))
