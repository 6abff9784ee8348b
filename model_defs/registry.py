"""Model definitions registered by Hugging Face architecture string (config.json `architectures[0]`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from .config import ModelConfig, ModelConfigError
from .layers.fusion import checkpoint_sources


@dataclass(frozen=True)
class ModelDef:
    """How to build one architecture: parse its config, make its network, find its weights."""

    architecture: str
    parse_config: Callable[[dict[str, Any]], ModelConfig]
    model_class: Callable[[ModelConfig], nn.Module]
    # kiln parameter name -> checkpoint tensor names concatenated along dim 0.
    sources: Callable[[str], tuple[str, ...]] = checkpoint_sources


_REGISTRY: dict[str, ModelDef] = {}


def register(model_def: ModelDef) -> None:
    if model_def.architecture in _REGISTRY:
        raise ValueError(f"architecture {model_def.architecture} registered twice")
    _REGISTRY[model_def.architecture] = model_def


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_def(architecture: str) -> ModelDef:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ModelConfigError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        ) from None


def model_def_for_hf_config(raw: dict[str, Any]) -> ModelDef:
    archs = raw.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ModelConfigError(
            "config.json has no 'architectures' list; supported: " + ", ".join(supported_architectures())
        )
    return get_model_def(archs[0])
