"""TensorRT-LLM's LoRA task ids over a server's adapters (`LoRAModules`), for kiln serve's KServe front ends and
the Triton repository model.

The first request of a task id carries the adapter (`lora_weights` + `lora_config`, TensorRT-LLM's layout:
kiln/checkpoints/trtllm_lora.py); it is written as a PEFT directory under a per-server temporary directory
(removed when the server goes) and served under the name `lora-task-<id>` like any adapter, so in-use counts,
metrics and /v1/unload_lora_adapter apply to it. Later requests send the id alone. Sending other weights under
a served id is refused: TensorRT-LLM keeps the cached adapter and silently ignores them, which hides a client's
mistake. The directory's name holds a digest of the tensors, which tells a repeat of the same weights (served
as is) from other ones.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.runtime import LoRARequest
from kiln.serve.errors import InvalidRequest
from kiln.serve.lora_modules import LoRAModules

TASK_ID, WEIGHTS, CONFIG = "lora_task_id", "lora_weights", "lora_config"


@dataclass(frozen=True, eq=False)
class TritonLoRA:
    """One request row's LoRA inputs as sent: the task id, and the adapter the first time (weights [N, L],
    config [N, 3 or 4]), else None for both."""

    task_id: int
    weights: np.ndarray | None = None
    config: np.ndarray | None = None


def parse_lora(task_id: int | None, weights: np.ndarray | None, config: np.ndarray | None) -> TritonLoRA | None:
    """A row's LoRA inputs, checked to come together as TensorRT-LLM wants them (shapes: `LoRATasks.resolve`)."""
    if task_id is None and weights is None and config is None:
        return None
    if (weights is None) != (config is None):
        missing = CONFIG if config is None else WEIGHTS
        raise InvalidRequest(f"input '{missing}' is missing: {WEIGHTS} and {CONFIG} are sent together (with "
                             f"{TASK_ID}) the first time a LoRA task is used", missing)
    if task_id is None:
        raise InvalidRequest(f"input '{TASK_ID}' is missing: {WEIGHTS} and {CONFIG} need the task id to cache the "
                             "adapter under", TASK_ID)
    return TritonLoRA(task_id, weights, config)


def task_name(task_id: int) -> str:
    """The served name of a task's adapter (a `model` of the OpenAI API too)."""
    return f"lora-task-{task_id}"


def _digest(lora: TritonLoRA) -> str:
    h = hashlib.sha256()
    for array in (lora.config.astype("<i4"), lora.weights.astype("<f2")):
        h.update(repr(array.shape).encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()[:16]


class LoRATasks:
    """Task ids -> the adapters of `loras` (LoRAModules over the AsyncLLM `llm`). `off_hint` says how to turn
    LoRA on; `unload_hint` how to drop a task's adapter (kiln serve has /v1/unload_lora_adapter)."""

    def __init__(self, llm, loras: LoRAModules, off_hint: str, unload_hint: str = "") -> None:
        self.loras = loras
        self.off_hint = off_hint
        self.unload_hint = unload_hint
        engine = getattr(llm, "engine", None)
        self._model_config = getattr(engine, "model_config", None)
        self._max_lora_rank = getattr(getattr(engine, "runtime", None), "max_lora_rank", 0)
        self._root: Path | None = None

    def needs_loading(self, lora: TritonLoRA | None) -> bool:
        """Whether `resolve` would convert and read an adapter (slow: run it off the event loop)."""
        return lora is not None and lora.weights is not None and self.loras.enabled \
            and task_name(lora.task_id) not in self.loras.names

    def resolve(self, lora: TritonLoRA | None) -> LoRARequest | None:
        """The adapter a row runs with (None: the base model); InvalidRequest naming the input otherwise."""
        if lora is None:
            return None
        if not self.loras.enabled:
            raise InvalidRequest(f"input '{TASK_ID}' ({lora.task_id}): this model serves no LoRA adapters; "
                                 f"{self.off_hint}", TASK_ID)
        name = task_name(lora.task_id)
        served = self.loras.lookup(name) if name in self.loras.names else None
        if lora.weights is None:
            if served is None:  # TensorRT-LLM's words, which its users search for
                raise InvalidRequest(f"LoRA task {lora.task_id} not found in cache. Please send LoRA weights with "
                                     f"request (inputs '{WEIGHTS}' and '{CONFIG}' with '{TASK_ID}' "
                                     f"{lora.task_id}, as TensorRT-LLM's hf_lora_convert.py makes them)", TASK_ID)
            return served
        from kiln.checkpoints.trtllm_lora import TRTLLMLoRAError, check_shapes

        try:
            check_shapes(lora.weights, lora.config)
        except TRTLLMLoRAError as e:
            raise InvalidRequest(f"LoRA task {lora.task_id}: {e}", e.tensor) from None
        key = _digest(lora)
        if served is not None:
            if Path(served.lora_path).name == _dir_name(lora.task_id, key):
                return served
            raise InvalidRequest(f"input '{WEIGHTS}': LoRA task {lora.task_id} is already loaded (as '{name}') with "
                                 f"other weights; send '{TASK_ID}' alone to use it, or a new '{TASK_ID}' for these "
                                 f"weights{self.unload_hint.format(name=name)}", WEIGHTS)
        return self._load(lora, name, key)

    def _load(self, lora: TritonLoRA, name: str, key: str) -> LoRARequest:
        from kiln.checkpoints.trtllm_lora import TRTLLMLoRAError, convert, write_peft_adapter

        try:
            tensors = convert(lora.weights, lora.config, self._model_config, self._max_lora_rank)
        except TRTLLMLoRAError as e:
            raise InvalidRequest(f"LoRA task {lora.task_id}: {e}", e.tensor) from None
        directory = self._root_dir() / _dir_name(lora.task_id, key)
        if not (directory / "adapter_model.safetensors").is_file():
            staging = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
            write_peft_adapter(staging, tensors)
            try:
                os.rename(staging, directory)
            except OSError:  # written meanwhile by a request with the same weights
                shutil.rmtree(staging, ignore_errors=True)
        try:
            return self.loras.add(name, str(directory))
        except InvalidRequest as e:
            if name in self.loras.names and self.loras.lookup(name).lora_path == str(directory):
                return self.loras.lookup(name)  # loaded meanwhile by a request with the same weights
            raise InvalidRequest(f"input '{WEIGHTS}' (LoRA task {lora.task_id}): {e.message}", WEIGHTS) from None

    def _root_dir(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="kiln-lora-tasks-"))
            weakref.finalize(self, shutil.rmtree, str(self._root), True)
        return self._root


def _dir_name(task_id: int, key: str) -> str:
    return f"task-{task_id}-{key}"
