"""Which checkpoint tensors make up each fused kiln parameter.

A fused parameter is the row-wise concatenation (dim 0) of its parts, in the order given here; that is
the layout `Attention.split_sizes` and `silu_and_mul` expect.
"""

from __future__ import annotations

FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_sources(param_name: str) -> tuple[str, ...]:
    """Hugging Face names whose concatenation is `param_name`, e.g.
    'model.layers.0.self_attn.qkv_proj.weight' -> (…q_proj.weight, …k_proj.weight, …v_proj.weight)."""
    parts = param_name.split(".")
    for i, part in enumerate(parts):
        if part in FUSED_MODULES:
            return tuple(".".join(parts[:i] + [src] + parts[i + 1:]) for src in FUSED_MODULES[part])
    return (param_name,)
