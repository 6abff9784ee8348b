"""Model definitions, one file per architecture family, registered by HF architecture string."""

from . import (  # noqa: F401  (registers the architectures)
           deepseek,
           eagle3_head,
           gemma2,
           gemma3,
           gpt_oss,
           granite,
           llama,
           moe,
           olmo2,
           phi3,
           qwen2,
           qwen3,
           smollm3,
           starcoder2,
)
from .config import ModelConfig, ModelConfigError
from .network import build_network
from .protocol import CausalLM
from .recipes import Recipe
from .registry import ModelDef, get_model_def, model_def_for_hf_config, supported_architectures

__all__ = ["CausalLM", "ModelConfig", "ModelConfigError", "ModelDef", "Recipe", "build_network", "get_model_def",
           "model_def_for_hf_config", "supported_architectures"]
