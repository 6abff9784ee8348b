"""What a quantization format gives the network builder: a linear method per layer.

A format (fp8, int8_sq, int4_awq, a pre-quantized checkpoint's `quantization_config`, ...) is one small
class implementing `QuantConfig`; `build_network(..., quant=...)` hands it to the LinearFactory, which asks
it for each linear layer's method. Model files never see it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from kiln.model_defs.layers.linear import LinearMethod


@runtime_checkable
class QuantConfig(Protocol):
    """Chooses how each linear layer of a network stores and multiplies its weights."""

    def linear_method(self, prefix: str, in_features: int, out_features: int,
                      dtype: torch.dtype) -> LinearMethod | None:
        """The method for the layer at module path `prefix` (e.g. "model.layers.0.mlp.down_proj", or
        "lm_head"), whose activations are `dtype`; None leaves that layer unquantized."""
        ...
