"""Kernel launch settings tuned for one GPU: chosen when the engine is built, used when it runs.

`kiln build --device cuda` times the candidate launch configurations of the kernels that have them for the
engine's own shapes (builder/tune.py) and records the winners in engine.json's `target.kernel_settings`:
{kernel name: {shape key: {setting: value}}}. The engine loader installs that table here before the first
step; a kernel looks its shape up and falls back to its shape heuristic when the table has nothing (CPU
engines, shapes not tuned, engines built with --no-tune). Nothing is timed at startup.

The table is per process, keyed by kernel and shape: engines in one process share it (tuned on the same GPU,
one shape's winner is the same for both).
"""

from __future__ import annotations

from collections.abc import Mapping

_TABLE: dict[str, dict[str, dict]] = {}


def install(settings: Mapping[str, Mapping[str, Mapping]]) -> None:
    """Adds an engine's kernel_settings ({kernel: {shape key: settings}}) to the table."""
    for kernel, shapes in settings.items():
        _TABLE.setdefault(kernel, {}).update({key: dict(cfg) for key, cfg in shapes.items()})


def lookup(kernel: str, key: str) -> dict | None:
    """The tuned settings of `kernel` for the shape `key`, or None (use the kernel's heuristic)."""
    shapes = _TABLE.get(kernel)
    return None if shapes is None else shapes.get(key)


def clear() -> None:
    """Forgets every tuned setting (tests)."""
    _TABLE.clear()
