"""Random weights from config.json alone, for benchmarking engines without downloading a checkpoint."""

from __future__ import annotations

import zlib

import torch

from .safetensors_writer import TensorSpec


def dummy_tensor(spec: TensorSpec, seed: int, device: str = "cpu") -> torch.Tensor:
    """Deterministic per (seed, name, device type): norms are ones, biases zeros, floating matrices
    N(0, 0.02) like HF's init, integer tensors (packed quantized weights, whose dtype the network's linear
    method declares) uniform over their dtype's range. Drawn on `device` (a CUDA build draws 8B values in
    a second instead of a minute); returned on the CPU."""
    if spec.name.endswith("norm.weight"):
        return torch.ones(spec.shape, dtype=spec.dtype)
    if spec.name.endswith(".bias"):
        return torch.zeros(spec.shape, dtype=spec.dtype)
    generator = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    if not spec.dtype.is_floating_point:
        info = torch.iinfo(spec.dtype)
        return torch.randint(info.min, info.max, spec.shape, dtype=spec.dtype, device=device,
                             generator=generator).cpu()
    values = torch.empty(spec.shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=generator)
    return values.to(spec.dtype).cpu()
