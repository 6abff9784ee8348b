"""Shared layers that every model file is built from."""

from .context import ForwardContext
from .decoder import DecoderForCausalLM
from .linear import Linear, LinearFactory, LinearMethod, TensorDecl, UnquantizedLinear
from .mlp import GatedMLP, MLPFactory

__all__ = ["DecoderForCausalLM", "ForwardContext", "GatedMLP", "Linear", "LinearFactory", "LinearMethod",
           "MLPFactory", "TensorDecl", "UnquantizedLinear"]
