"""Small per-step tensors built from Python data on the host (step inputs, sampling parameters)."""

from __future__ import annotations

import torch


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `data` on `device`. On CUDA it goes through pinned memory with a non-blocking copy, so
    building it does not wait for the GPU work queued before it."""
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
