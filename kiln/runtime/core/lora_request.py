"""`LoRARequest`: which LoRA adapter a request runs with (vLLM's name and fields; plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A Hugging Face PEFT adapter directory (`lora_path`) under a name and an id >= 1 that the engine keys
    its slots and prefix cache by: one id always means one adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} must be an integer >= 1 (0 is the base model)")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} must be a non-empty string")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r} must be a non-empty string (an adapter directory)")
