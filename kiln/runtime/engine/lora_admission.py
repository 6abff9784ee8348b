"""The engine's side of LoRA adapters: reading a request's adapter (any thread), admitting it into the executor
(the engine thread, cheap once read), and pinning it there while the request lives.

Reading is split from admitting so that a slow disk never stalls the engine thread: `AsyncLLM.generate` reads an
adapter the executor does not hold on a worker thread (`read`) and the engine thread only keeps it (`admit`).
Every live request (waiting, running, preempted) pins its adapter in host memory from `pin` (its admission)
until `release` (the one place a request leaves the engine), so the executor never has to read it again
before a step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kiln.checkpoints.lora_adapter import LoRAAdapter
from kiln.checkpoints.peft import read_lora_adapter
from kiln.model_defs.config import ModelConfig
from kiln.runtime.core.lora_request import LoRARequest
from kiln.runtime.worker.engine_loader import RuntimeConfig


class LoRAAdmission:
    """One engine's adapters. `executor`: has add_lora / holds_lora / pin_lora / lora_stats when
    `runtime.enable_lora` (worker/executor.py)."""

    def __init__(self, executor, runtime: RuntimeConfig, model_config: ModelConfig) -> None:
        self.executor = executor
        self.enabled = runtime.enable_lora
        self.max_lora_rank = runtime.max_lora_rank
        self.model_config = model_config
        self._lora_of: dict[str, int] = {}  # live request id -> the adapter id it pins

    def read(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Reads and checks the adapter from disk; thread-safe. A ValueError names the adapter and the problem
        (the same text `admit` gives)."""
        self._check(lora_request)
        with _named(lora_request):
            return read_lora_adapter(lora_request.lora_path, self.model_config, max_lora_rank=self.max_lora_rank,
                                     name=lora_request.lora_name)

    def holds(self, lora_request: LoRARequest) -> bool:
        """Whether the executor has the adapter in host memory (admitting it then reads nothing); any thread.
        A stale answer only costs a read: one evicted meanwhile is read again by `admit`."""
        return self.enabled and isinstance(lora_request, LoRARequest) and \
            self.executor.holds_lora(lora_request.lora_int_id)

    def admit(self, lora_request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Hands the adapter to the executor (engine thread): `adapter` from `read`, or None to have it read
        now unless held. A ValueError names what cannot be served."""
        self._check(lora_request)
        with _named(lora_request):
            self.executor.add_lora(lora_request, adapter)

    def pin(self, request_id: str, lora_int_id: int) -> None:
        """Request `request_id` (admitted, its adapter added) is live now; 0: the base model."""
        if lora_int_id:
            self.executor.pin_lora(lora_int_id, True)
            self._lora_of[request_id] = lora_int_id

    def release(self, request_id: str) -> None:
        """Request `request_id` has left the engine (finished, aborted, failed): its adapter may be evicted."""
        lora_int_id = self._lora_of.pop(request_id, 0)
        if lora_int_id:
            self.executor.pin_lora(lora_int_id, False)

    def stats(self) -> dict[str, int] | None:
        """The executor's plain LoRA counters (slot_loads, disk_reads, host_adapters, pinned_adapters,
        device_slots); None without enable_lora."""
        return self.executor.lora_stats() if self.enabled else None

    def _check(self, lora_request: LoRARequest) -> None:
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if not self.enabled:
            raise ValueError(f"lora_request {lora_request.lora_name!r} needs the engine started with "
                             f"enable_lora=True (--enable-lora)")


@contextlib.contextmanager
def _named(lora_request: LoRARequest) -> Iterator[None]:
    """Prefixes a ValueError with the adapter it is about."""
    try:
        yield
    except ValueError as e:
        r = lora_request
        raise ValueError(f"LoRA adapter {r.lora_name!r} (lora_int_id={r.lora_int_id}, {r.lora_path}): {e}") \
            from None
