"""LoRA adapters a server serves by name (vLLM's `--lora-modules` and /v1/load_lora_adapter): parsing the flag's
values, checking an adapter before it is served, and the live set of adapters with the requests using each."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from kiln.runtime import LoRARequest
from kiln.serve.errors import InvalidRequest, NotFound, RequestError


class Conflict(RequestError):
    """The request clashes with the server's state (an adapter in use cannot be unloaded)."""

    status = 409
    grpc_code = "FAILED_PRECONDITION"


class ModelNotFound(NotFound):
    """A request's `model` is neither the base model nor a served adapter (OpenAI's and vLLM's error code)."""

    openai_code = "model_not_found"


def parse_lora_module(spec: str) -> tuple[str, str]:
    """`name=path` or vLLM's JSON `{"name": ..., "path": ...}` -> (name, path); a ValueError naming the flag."""
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            value = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {spec!r}: invalid JSON ({e})") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
                or not isinstance(value.get("path"), str):
            raise ValueError(f"--lora-modules {spec!r}: JSON must be an object with string 'name' and 'path'")
        name, path = value["name"], value["path"]
    else:
        name, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {spec!r}: must be name=path (or JSON with 'name' and 'path')")
    if not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules {spec!r}: both the name and the path must be non-empty")
    return name.strip(), path.strip()


class LoRAModules:
    """The adapters served, by name. Ids are never reused: the engine keys its adapter caches and prefix-cache
    hashes by id, so an adapter loaded again under an old name gets a fresh one. `check` reads an adapter
    against the engine (kiln.checkpoints.peft) and raises LoRAError naming what is wrong."""

    def __init__(self, base_name: str, enabled: bool, check=None) -> None:
        self.base_name = base_name
        self.enabled = enabled
        self._check = check
        self._ids = itertools.count(1)
        self._adapters: dict[str, LoRARequest] = {}
        self._in_use: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        return list(self._adapters)

    def __len__(self) -> int:
        return len(self._adapters)

    def add(self, name: str, path: str) -> LoRARequest:
        """Checks the adapter and serves it as `name`; InvalidRequest for a taken name or a bad adapter."""
        if name == self.base_name or name in self._adapters:
            raise InvalidRequest(f"lora_name={name!r} is already served; unload it first or pick another name",
                                 "lora_name")
        if not Path(path).is_dir():
            raise InvalidRequest(f"lora_path={path!r} for {name!r} is not a directory (a PEFT adapter directory "
                                 "with adapter_config.json)", "lora_path")
        if self._check is not None:
            try:
                self._check(path, name)
            except ValueError as e:
                raise InvalidRequest(f"LoRA adapter {name!r} ({path}): {e}", "lora_path") from None
        if name in self._adapters:  # loaded by another request while this one was being read
            raise InvalidRequest(f"lora_name={name!r} is already served", "lora_name")
        request = LoRARequest(name, next(self._ids), str(path))
        self._adapters[name] = request
        return request

    def remove(self, name: str) -> None:
        """Stops serving `name`; NotFound if unknown, Conflict while requests use it (they are never cut off)."""
        if name not in self._adapters:
            raise NotFound(f"LoRA adapter {name!r} is not loaded; loaded: {', '.join(self._adapters) or 'none'}",
                           "lora_name")
        if self._in_use.get(name, 0):  # counted once per HTTP request and once per engine request it runs
            raise Conflict(f"LoRA adapter {name!r} is in use by running requests; unload it once they finish",
                           "lora_name")
        del self._adapters[name]

    def lookup(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` selects: None for the base model (or no model); NotFound naming the
        served models otherwise."""
        if model is None or model == self.base_name:
            return None
        if model in self._adapters:
            return self._adapters[model]
        available = ", ".join([self.base_name, *self._adapters])
        raise ModelNotFound(f"The model '{model}' does not exist; this server serves: {available}", "model")

    def acquire(self, lora: LoRARequest | None) -> None:
        """One more request uses `lora` (None: the base model, nothing to count); `release` when it is over."""
        if lora is not None:
            self._in_use[lora.lora_name] = self._in_use.get(lora.lora_name, 0) + 1

    def release(self, lora: LoRARequest | None) -> None:
        if lora is not None:
            left = self._in_use.get(lora.lora_name, 0) - 1
            if left > 0:
                self._in_use[lora.lora_name] = left
            else:
                self._in_use.pop(lora.lora_name, None)

    @contextlib.contextmanager
    def using(self, lora: LoRARequest | None) -> Iterator[LoRARequest | None]:
        """Counts `lora` as in use for the block: from the moment a request resolved it (call this with no await
        between `lookup` and here) until the request is over, whether it succeeded, failed or its client went
        away, so that unloading the adapter meanwhile is refused."""
        self.acquire(lora)
        try:
            yield lora
        finally:
            self.release(lora)

    def users(self, name: str) -> int:
        """The requests using adapter `name` now."""
        return self._in_use.get(name, 0)


def server_loras(llm, base_name: str, modules: tuple[tuple[str, str], ...]) -> LoRAModules:
    """The adapters of a server over AsyncLLM `llm`: each of `modules` read once and checked against the
    engine's model (a ValueError naming the adapter, its path and what is wrong stops the server starting)."""
    engine = getattr(llm, "engine", None)  # a stand-in engine of a test may have none: no LoRA then
    enabled = bool(getattr(getattr(engine, "runtime", None), "enable_lora", False))

    def check(path: str, name: str) -> None:
        from kiln.checkpoints.peft import read_lora_adapter

        read_lora_adapter(path, engine.model_config, max_lora_rank=engine.runtime.max_lora_rank, name=name)

    loras = LoRAModules(base_name, enabled, check)
    if modules and not enabled:
        raise ValueError(f"--lora-modules {' '.join(name for name, _ in modules)} needs --enable-lora")
    for name, path in modules:
        try:
            loras.add(name, path)
        except RequestError as e:
            raise ValueError(f"--lora-modules {name}={path}: {e.message}") from None
    return loras
