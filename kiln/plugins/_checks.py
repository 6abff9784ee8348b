"""Argument checks shared by the operator wrappers: they run before any kernel launch, so a bad call
fails with a message that names the argument instead of a device-side fault."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_dims(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in allowed]}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_size(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(f"{name}.shape[{dim}] is {t.shape[dim]}, expected {expected} ({what})")
