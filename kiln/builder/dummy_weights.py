"""Random weights from config.json alone, for benchmarking engines without downloading a checkpoint."""

from __future__ import annotations

import torch

from kiln.model_defs.dummy_weights import dummy_tensor as _draw

from .safetensors_writer import TensorSpec


def dummy_tensor(spec: TensorSpec, seed: int, device: str = "cpu") -> torch.Tensor:
    """`kiln.model_defs.dummy_weights.dummy_tensor` of this spec, drawn on `device` (a CUDA build draws 8B
    values in a second instead of a minute) and returned on the CPU."""
    return _draw(spec.name, spec.shape, spec.dtype, seed, device).cpu()
