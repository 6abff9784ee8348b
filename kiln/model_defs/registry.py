"""Model definitions registered by Hugging Face architecture string (config.json `architectures[0]`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from .config import ModelConfig, ModelConfigError
from .config_limits import check_hf_counts
from .layers.linear import LinearFactory
from .layers.mlp import GatedMLP, MLPFactory
from .recipes import Recipe, fused_recipes


@dataclass(frozen=True)
class ModelDef:
    """How to build one architecture: parse its config, make its network, find its weights.

    `build_network` calls `model_class(config, linears, mlp)`; the result implements `CausalLM`.
    """

    architecture: str
    parse_config: Callable[[dict[str, Any]], ModelConfig]
    model_class: Callable[[ModelConfig, LinearFactory, MLPFactory], nn.Module]
    # Each decoder layer's MLP block; an MoE architecture supplies its expert block here.
    mlp: MLPFactory = GatedMLP
    # (config, engine tensor names) -> how each engine tensor is made from checkpoint tensors.
    recipes: Callable[[ModelConfig, Iterable[str]], dict[str, Recipe]] = fused_recipes
    # Why the family does not run on CUDA yet (a build or load for a GPU is refused with it); None: it does.
    cuda_refusal: str | None = None


_REGISTRY: dict[str, ModelDef] = {}
# Architectures kiln knows and refuses with a reason (a multimodal checkpoint whose text model it does run).
_REFUSED: dict[str, str] = {}


def register(model_def: ModelDef) -> None:
    if model_def.architecture in _REGISTRY:
        raise ValueError(f"architecture {model_def.architecture} registered twice")
    _REGISTRY[model_def.architecture] = model_def


def refuse(architecture: str, reason: str) -> None:
    """Makes get_model_def refuse `architecture` with `reason` instead of the bare list of supported ones."""
    _REFUSED[architecture] = reason


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_def(architecture: str) -> ModelDef:
    if architecture in _REFUSED:
        raise ModelConfigError(f"architecture {architecture!r} is not supported: {_REFUSED[architecture]}")
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ModelConfigError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        ) from None


def model_def_for_hf_config(raw: dict[str, Any]) -> ModelDef:
    """The ModelDef for a config.json, whose counts are checked against kiln's limits first (config_limits.py):
    its parser may size per-layer tuples by them before ModelConfig checks anything."""
    check_hf_counts(raw)
    archs = raw.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ModelConfigError(
            "config.json has no 'architectures' list; supported: " + ", ".join(supported_architectures())
        )
    return get_model_def(archs[0])
