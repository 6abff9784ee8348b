"""FP8 activations handed from their producer to the linear that consumes them.

An FP8 linear (W8A8) quantizes its input before its GEMM. When the input comes straight from an RMSNorm
or from SiLU-and-mul, that op can write FP8 itself (plugins/norm_quant.py) and save the linear a pass over
the activations: a read of [T, K] in 16 bits, a write in 8, and a launch. The producer asks its consumer
`fp8_consumer(linear)` once per call; the consumer's method says whether it takes pre-quantized input
(`LinearMethod.accepts_fp8_input`) and with which scale. What the consumer computes is bit for bit what
it computes from the float input (the fused references are the float op followed by scaled_linear's
quantization).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class Fp8Input(NamedTuple):
    """An FP8 linear's input, quantized by its producer."""

    x_q: torch.Tensor  # [T, K] float8_e4m3fn
    x_scale: torch.Tensor  # [T, 1] float32: each row's scale (a static scale repeated)


class Fp8Consumer(NamedTuple):
    """The linear a producer feeds, when that linear takes FP8 input. A tuple, not the module itself: a module
    set as an attribute of the norm would become its submodule (and its tensors appear twice in state_dict)."""

    linear: nn.Module

    @property
    def takes_fp8(self) -> bool:
        """False while the linear has LoRA adapters (runtime/worker/lora_slots.py hooks them on after the model
        is built): they multiply the float input, so the producer hands floats and the linear quantizes them
        itself (the same numbers, one pass more)."""
        return getattr(self.linear, "lora_hook", None) is None

    @property
    def input_scale(self) -> torch.Tensor | None:
        """[1] float32, the calibrated static scale, or None for per-token dynamic scales. Read at call time:
        loading an engine replaces the layer's parameters."""
        return getattr(self.linear, "input_scale", None)


def fp8_consumer(linear: nn.Module | None) -> Fp8Consumer | None:
    """`linear` as a consumer of FP8 input, or None when it is absent or quantizes its input its own way."""
    method = getattr(linear, "method", None)
    return Fp8Consumer(linear) if getattr(method, "accepts_fp8_input", False) else None
