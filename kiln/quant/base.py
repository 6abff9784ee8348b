"""What a quantization format gives the network builder and the engine builder.

A format (fp8, int8_sq, int4_awq, ...) is one small module with a `QuantConfig` (which linear layers it
quantizes, and with which `QuantizedLinearMethod`) and that method: the tensors a layer stores, the
product it computes at run time, and `quantize`, which turns a layer's float weight parts plus the
calibration's statistics into those tensors at build time. `build_network(..., quant=...)` hands the
config to the LinearFactory; model files never see it.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# QuantConfig is defined beside the LinearFactory that asks it (model_defs sits below quant and must not
# import it); re-exported here, where the formats and the builder look for it.
from kiln.model_defs.layers.linear import LinearMethod
from kiln.model_defs.layers.linear import QuantConfig as QuantConfig


class QuantError(ValueError):
    """A format a layer, file or setting cannot take; the message names the layer, file or flag."""


@dataclass(frozen=True)
class LinearPart:
    """One checkpoint linear layer that an engine layer is made of (q_proj of a fused qkv_proj), as the
    calibration left it.

    ModelOpt's SmoothQuant and AWQ scale the weight's input columns and leave the inverse on the input
    (`pre_quant_scale`): the layer computes (x * pre_quant_scale) @ weight^T. Amax shapes are ModelOpt's:
    [] per tensor, [out, 1] per channel, [out * in / group, 1] per block.
    """

    name: str  # checkpoint module path, e.g. "model.layers.0.self_attn.q_proj"
    weight: torch.Tensor  # [out_i, in] float32
    weight_amax: torch.Tensor | None = None
    input_amax: torch.Tensor | None = None  # [] : the calibrated range of the (smoothed) input
    pre_quant_scale: torch.Tensor | None = None  # [in] float32

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


class QuantizedLinearMethod(LinearMethod):
    """A linear method whose tensors the engine builder makes from float weights and calibration data."""

    needs_calibration: bool = False  # whether `quantize` needs activation statistics (input amax)

    @abstractmethod
    def quantize(self, parts: Sequence[LinearPart]) -> dict[str, torch.Tensor]:
        """The layer's tensors (every declared one but `bias`, which stays float) from its parts, whose
        rows are concatenated in order ([q; k; v], [gate; up])."""
