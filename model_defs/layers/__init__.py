"""Shared layers that every model file is built from."""

from .context import ForwardContext
from .decoder import DecoderForCausalLM
from .fusion import checkpoint_sources

__all__ = ["DecoderForCausalLM", "ForwardContext", "checkpoint_sources"]
