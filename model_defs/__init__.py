"""Model definitions, one file per architecture family, registered by HF architecture string."""

from . import llama, qwen2, qwen3  # noqa: F401  (registers the architectures)
from .config import ModelConfig, ModelConfigError
from .registry import ModelDef, get_model_def, model_def_for_hf_config, supported_architectures

__all__ = ["ModelConfig", "ModelConfigError", "ModelDef", "get_model_def", "model_def_for_hf_config",
           "supported_architectures"]
