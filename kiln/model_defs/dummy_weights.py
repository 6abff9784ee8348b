"""Random weights for benchmarking, drawn by name: the builder writes them into a dummy-weight engine, and the
runtime draws them on the device at load for an engine built without weight files (vLLM's `--load-format
dummy`), so a model whose weights do not fit the disk can still be measured."""

from __future__ import annotations

import zlib

import torch
from torch import nn


def dummy_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Deterministic per (seed, name, device type), on `device`: norms are ones, biases zeros, floating
    matrices N(0, 0.02) like HF's init, integer tensors (packed quantized weights, whose dtype the network's
    linear method declares) uniform over their dtype's range."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    if name.endswith(".weight_scales"):  # MXFP4 E8M0 scales (layers/mxfp4_experts.py): 2 ** -7, so that random
        return torch.full(shape, 120, dtype=dtype, device=device)  # E2M1 codes (RMS 2.9) give weights of RMS 0.023
    generator = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, dtype=dtype, device=device, generator=generator)
    values = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=generator)
    return values.to(dtype)


@torch.no_grad()
def draw_dummy_weights(model: nn.Module, seed: int, device: torch.device) -> None:
    """Gives every tensor of a network built on the meta device a dummy value on `device`, one tensor at a
    time (no float32 copy of the whole model is ever held)."""
    for name, tensor in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        value = dummy_tensor(name, tuple(tensor.shape), tensor.dtype, seed, device)
        setattr(module, attr, nn.Parameter(value, requires_grad=tensor.requires_grad))
