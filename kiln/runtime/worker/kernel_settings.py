"""Hands an engine's build-time kernel tuning (engine.json target.kernel_settings) to the kernels.

The settings were timed on the GPU the engine was built on (builder/tune.py). On the same GPU model they are
installed as they are; on another one they are correct but timed elsewhere, so they are left out (the kernels
fall back to their shape heuristics) with a warning naming both GPUs and the rebuild that tunes for this one.
An engine whose formats this GPU cannot run at all is refused earlier (device_support.py).
"""

from __future__ import annotations

import logging

import torch

from kiln.engine_format import EngineError, EngineSpec

logger = logging.getLogger("kiln.runtime")


def install_kernel_settings(spec: EngineSpec, device: torch.device) -> bool:
    """Installs spec.target's kernel_settings for `device` when they were tuned on its GPU model; returns
    whether they were installed."""
    settings = spec.target.get("kernel_settings") or {}
    _check(spec, settings)
    if device.type != "cuda" or not settings:
        return False
    built_on, here = spec.target.get("gpu_name"), torch.cuda.get_device_name(device)
    if built_on != here:
        logger.warning("engine %s was tuned for %s but runs on %s: its tuned kernel settings are left out and "
                       "the kernels use their shape heuristics; rebuild it on this GPU (kiln build --device "
                       "cuda) to tune for it", spec.engine_dir, built_on, here)
        return False
    from kiln.plugins import tuning

    tuning.install(settings)
    logger.info("kernel settings tuned for %s: %s", here,
                ", ".join(f"{kernel} ({len(shapes)} shapes)" for kernel, shapes in settings.items()))
    return True


def _check(spec: EngineSpec, settings) -> None:
    """{kernel: {shape key: {setting: int}}}, as builder/tune.py writes it; anything else is an EngineError
    naming the entry (a hand-edited engine.json), rather than a TypeError inside a kernel launch."""
    where = f"{spec.engine_dir / 'engine.json'}: target.kernel_settings"
    if not isinstance(settings, dict):
        raise EngineError(f"{where} is {settings!r}, not an object; rebuild the engine or set it to {{}}")
    for kernel, shapes in settings.items():
        if not isinstance(shapes, dict):
            raise EngineError(f"{where}.{kernel} is {shapes!r}, not an object of shape keys")
        for key, values in shapes.items():
            if not isinstance(values, dict) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values.values()):
                raise EngineError(f"{where}.{kernel}.{key} is {values!r}: settings must be positive integers; "
                                  f"rebuild the engine (kiln build --device cuda) or remove the entry")
