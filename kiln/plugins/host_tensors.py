"""Small per-step tensors built from Python data on the host (step inputs, sampling parameters, the MLA split),
here at the bottom so that the runtime and the model layers share one pinned, non-blocking copy."""

from __future__ import annotations

import numpy as np
import torch


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `data` on `device`. On CUDA it goes through pinned memory with a non-blocking copy, so
    building it does not wait for the GPU work queued before it."""
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def array_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a tensor on `device` (on the CPU it shares the array's memory), through pinned memory and a
    non-blocking copy on CUDA like `to_device`."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
