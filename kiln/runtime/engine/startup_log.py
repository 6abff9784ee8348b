"""Where an engine's startup time goes: one line of stage times, logged when the engine is ready."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StartupLog:
    """Stages in the order they ran, each with its seconds and an optional note (e.g. what was installed)."""

    stages: list[tuple[str, float, str]] = field(default_factory=list)

    def add(self, name: str, seconds: float, note: str = "") -> None:
        self.stages.append((name, seconds, note))

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def summary(self) -> str:
        """e.g. `load/verify 0.41s, kernels 0.05s (312 kernel files installed), weights 2.10s, graphs 1.20s`."""
        return ", ".join(f"{name} {seconds:.2f}s" + (f" ({note})" if note else "")
                         for name, seconds, note in self.stages)
