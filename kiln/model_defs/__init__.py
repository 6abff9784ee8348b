"""Model definitions, one file per architecture family, registered by HF architecture string."""

from . import granite, llama, moe, olmo2, qwen2, qwen3, smollm3, starcoder2  # noqa: F401  (registers the architectures)
from .config import ModelConfig, ModelConfigError
from .network import build_network
from .protocol import CausalLM
from .recipes import Recipe
from .registry import ModelDef, get_model_def, model_def_for_hf_config, supported_architectures

__all__ = ["CausalLM", "ModelConfig", "ModelConfigError", "ModelDef", "Recipe", "build_network", "get_model_def",
           "model_def_for_hf_config", "supported_architectures"]
