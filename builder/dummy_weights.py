"""Random weights from config.json alone, for benchmarking engines without downloading a checkpoint."""

from __future__ import annotations

import zlib

import torch

from .safetensors_writer import TensorSpec


def dummy_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """Deterministic per (seed, name): norms are ones, biases zeros, matrices N(0, 0.02) like HF's init."""
    if spec.name.endswith("norm.weight"):
        return torch.ones(spec.shape, dtype=spec.dtype)
    if spec.name.endswith(".bias"):
        return torch.zeros(spec.shape, dtype=spec.dtype)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    return torch.empty(spec.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator).to(spec.dtype)
