"""GPT-OSS (transformers' modeling_gpt_oss.py): the Llama-family decoder with biases on q/k/v/o, a learned
attention sink per query head (`self_attn.sinks`), a sliding window on the `layer_types` sliding_attention layers
(every other layer, the first included, by default), YaRN rope, and a mixture of experts on every layer: a router
with a bias, top-k of its logits softmaxed over the chosen experts, experts with biases and the clamped SwiGLU
(`swiglu_limit`, `swiglu_alpha`).

The shared decoder with `layers/moe.py`'s MLP factory; ModelConfig's `attention_sinks` and MoEConfig's
`bias` / `swiglu_*` switch those parts on. The checkpoint stores each layer's experts stacked and transposed
(gate_up_proj [E, H, 2I] with gate and up interleaved column by column, down_proj [E, I, H]); the recipes
turn them into kiln's [E, 2I, H] ([gate; up] rows) and [E, H, I].

The released checkpoints store the experts' weights in MXFP4 (quantization_config.quant_method "mxfp4": tensors
`*_blocks` and `*_scales`, plugins/mxfp4.py). By default the engine keeps them so (kiln.quant.mxfp4: engine
tensors `experts.{gate_up,down}.weight_blocks` / `weight_scales`, the recipes only putting gate_up's rows as
[gate; up]); with `kiln build --dequantize` the recipes dequantize them and the engine holds the experts in its
dtype (BF16) as it would from a BF16 checkpoint.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .config import ModelConfig, ModelConfigError, MoEConfig, parse_decoder_config, required
from .gemma2 import gemma_layer_windows
from .layers import DecoderForCausalLM
from .layers.moe import moe_mlp
from .mxfp4 import dequantize_mxfp4
from .recipes import Recipe, fused_recipe
from .registry import ModelDef, register

_MOE = re.compile(r"(model\.layers\.\d+\.mlp)\.(gate|experts\.gate_up|experts\.down)\.(weight|bias|weight_blocks|"
                  r"weight_scales)")


def parse_gpt_oss(raw: dict[str, Any]) -> ModelConfig:
    """config.json as transformers' GptOssConfig reads it (its defaults for absent keys)."""
    layers = required(raw, "num_hidden_layers")
    bias = bool(raw.get("attention_bias", True))
    config = parse_decoder_config({**raw, "head_dim": raw.get("head_dim") or 64}, qkv_bias=bias, o_bias=bias,
                                  layer_sliding_windows=gemma_layer_windows(raw, 2))
    limit, alpha = raw.get("swiglu_limit", 7.0), raw.get("swiglu_alpha", 1.702)
    for key, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ModelConfigError(f"{key}={value!r:.80} must be a number > 0")
    quant = raw.get("quantization_config")
    mxfp4 = isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"  # other formats: detect.py decides
    moe = MoEConfig(num_experts=required(raw, "num_local_experts"), top_k=required(raw, "num_experts_per_tok"),
                    intermediate_size=config.intermediate_size, renormalize=True, sparse_layers=(True,) * layers,
                    bias=True, swiglu_limit=float(limit), swiglu_alpha=float(alpha), mxfp4_experts=mxfp4)
    return dataclasses.replace(config, moe=moe, attention_sinks=True)


def _interleaved_to_halves(t: torch.Tensor) -> torch.Tensor:
    # [..., 2I] with gate, up alternating -> [..., 2I] as [gate | up]
    return torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)


def _gate_up_weight(engine_name: str, part: str, t: torch.Tensor) -> torch.Tensor:
    return _interleaved_to_halves(t).transpose(1, 2).contiguous()  # [E, H, 2I] -> [E, 2I, H]


def _gate_up_bias(engine_name: str, part: str, t: torch.Tensor) -> torch.Tensor:
    return _interleaved_to_halves(t).contiguous()  # [E, 2I]


def _interleaved_rows(engine_name: str, part: str, t: torch.Tensor) -> torch.Tensor:
    # MXFP4 gate_up blocks [E, 2I, H / 32, 16] or scales [E, 2I, H / 32], rows gate, up alternating -> [gate; up]
    return torch.cat([t[:, ::2], t[:, 1::2]], dim=1).contiguous()


def _down_weight(engine_name: str, part: str, t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous()  # [E, I, H] -> [E, H, I]


@dataclass(frozen=True)
class DequantizeMxfp4:
    """A recipe's combine for an MXFP4 expert weight: parts (blocks [E, out, in / 32, 16], scales
    [E, out, in / 32]) -> [E, out, in] float32 (the writer casts it to the engine dtype); `interleaved`: the rows
    alternate gate and up (gate_up_proj), put as [gate; up]."""

    interleaved: bool

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        blocks, scales = parts
        w = dequantize_mxfp4(blocks, scales)  # [E, out, in]
        return torch.cat([w[:, ::2], w[:, 1::2]], dim=1) if self.interleaved else w


def gpt_oss_recipes(config: ModelConfig, engine_names: Iterable[str]) -> dict[str, Recipe]:
    """The router is `mlp.router`, the experts' tensors `mlp.experts.{gate_up_proj,down_proj}[_bias]` (the weights
    as `_blocks` and `_scales` in an MXFP4 checkpoint: copied into an MXFP4 engine's `weight_blocks` /
    `weight_scales`, dequantized into a float engine's `weight`); the rest (with `self_attn.sinks`) as the Llama
    family's."""
    out = {}
    for name in engine_names:
        m = _MOE.fullmatch(name)
        if m is None:
            out[name] = fused_recipe(name)
            continue
        base, module, kind = m.groups()
        if module == "gate":
            out[name] = Recipe((f"{base}.router.{kind}",))
        elif kind in ("weight_blocks", "weight_scales"):  # kept MXFP4 (kiln.quant.mxfp4)
            proj = f"{base}.experts.{'gate_up_proj' if module == 'experts.gate_up' else 'down_proj'}"
            out[name] = Recipe((f"{proj}_{kind[len('weight_'):]}",),
                               transform=_interleaved_rows if module == "experts.gate_up" else None)
        elif kind == "weight" and config.moe.mxfp4_experts:
            proj = f"{base}.experts.{'gate_up_proj' if module == 'experts.gate_up' else 'down_proj'}"
            out[name] = Recipe((f"{proj}_blocks", f"{proj}_scales"), DequantizeMxfp4(module == "experts.gate_up"))
        elif module == "experts.gate_up":
            part = f"{base}.experts.gate_up_proj" + ("_bias" if kind == "bias" else "")
            out[name] = Recipe((part,), transform=_gate_up_bias if kind == "bias" else _gate_up_weight)
        elif kind == "bias":
            out[name] = Recipe((f"{base}.experts.down_proj_bias",))
        else:
            out[name] = Recipe((f"{base}.experts.down_proj",), transform=_down_weight)
    return out


register(ModelDef("GptOssForCausalLM", parse_gpt_oss, DecoderForCausalLM, mlp=moe_mlp, recipes=gpt_oss_recipes))
