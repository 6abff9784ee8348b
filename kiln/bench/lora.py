"""The LoRA adapters an offline benchmark runs with (`kiln bench latency|throughput --enable-lora --lora-modules
name=DIR ... --num-loras K`): requests take the first K adapters round-robin, so a batch mixes K distinct
adapters (K = 0: every request runs the base model, which still measures what `--enable-lora` alone costs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln.runtime import LoRARequest


@dataclass(frozen=True)
class BenchLoRA:
    """The adapters requests use, in round-robin order (empty: the base model for every request)."""

    adapters: tuple[LoRARequest, ...] = ()

    def assign(self, count: int, offset: int = 0) -> list[LoRARequest | None]:
        """The adapter of each of `count` requests, round-robin from the `offset`-th (None: the base model)."""
        if not self.adapters:
            return [None] * count
        return [self.adapters[(offset + i) % len(self.adapters)] for i in range(count)]

    def to_json(self) -> dict:
        return {"num_loras": len(self.adapters),
                "adapters": [{"name": a.lora_name, "id": a.lora_int_id, "path": a.lora_path} for a in self.adapters]}


NO_LORA = BenchLoRA()  # every request runs the base model


def bench_loras(modules: list[tuple[str, str]], num_loras: int | None, enable_lora: bool) -> BenchLoRA:
    """`modules` (name, dir) as `--lora-modules` gives them, `num_loras` as `--num-loras` (None: all of them);
    a ValueError naming the flag for a missing directory, a repeated name, K out of range, or adapters without
    `--enable-lora`. Ids are 1, 2, ... in the order given."""
    if num_loras is None:
        num_loras = len(modules)
    if num_loras < 0:
        raise ValueError(f"--num-loras {num_loras} must be >= 0")
    if num_loras > len(modules):
        raise ValueError(f"--num-loras {num_loras} exceeds the {len(modules)} adapter(s) given by --lora-modules")
    if (modules or num_loras) and not enable_lora:
        raise ValueError("--lora-modules and --num-loras need --enable-lora")
    names: set[str] = set()
    for name, path in modules:
        if name in names:
            raise ValueError(f"--lora-modules {name}={path}: the name {name!r} is given twice")
        names.add(name)
        if not Path(path).is_dir():
            raise ValueError(f"--lora-modules {name}={path}: {path} is not a directory (a PEFT adapter directory "
                             "with adapter_config.json)")
    return BenchLoRA(tuple(LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(modules[:num_loras])))
