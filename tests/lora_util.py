"""Real PEFT LoRA adapters for the tests (the `peft` package): random lora_B, so an adapter changes the output."""

from __future__ import annotations

import copy
from pathlib import Path

import torch


def make_adapter(base, out: Path, seed: int = 0, safe: bool = True, **lora):
    """A PEFT adapter over a copy of `base` with random lora_B, saved to `out`; returns (out, PeftModel)."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**lora))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.05)
    model.save_pretrained(out, safe_serialization=safe)
    return out, model
