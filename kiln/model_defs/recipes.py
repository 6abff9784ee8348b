"""Weight recipes: how each engine tensor is made from checkpoint tensors.

A recipe names its parts (checkpoint tensor names), how they combine (one tensor as is, concatenated
along a dim, or stacked along a new dim) and an optional per-part transform that runs on each part
before combining (where a dequantizer would sit; tensor parallelism cuts the finished whole tensor per
rank, `builder/sharding.py`); AWQ/GPTQ pack along dim 1 and MoE experts stack, hence concatenation along
any dim and stacking.

A model def supplies `recipes(config, engine_names)`; `fused_recipes` is the Llama family's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from .config import ModelConfig

# (engine tensor name, checkpoint part name, part) -> the part as it goes into the combine.
PartTransform = Callable[[str, str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Single:
    """The engine tensor is its one part."""

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        (part,) = parts
        return part


@dataclass(frozen=True)
class Concat:
    """The parts concatenated along `dim` (dim 0: rows of a fused projection; dim 1: packed columns)."""

    dim: int = 0

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts), dim=self.dim)


@dataclass(frozen=True)
class Stack:
    """The parts stacked along a new `dim` (e.g. MoE experts: E x [out, in] -> [E, out, in])."""

    dim: int = 0

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack(list(parts), dim=self.dim)


@dataclass(frozen=True)
class StackGroups:
    """Consecutive groups of `group` parts, each concatenated along `dim`, stacked along a new dim 0 (MoE
    experts' gate and up rows: E x ([I, H], [I, H]) -> [E, 2I, H])."""

    group: int
    dim: int = 0

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        parts = list(parts)
        if len(parts) % self.group:
            raise ValueError(f"{len(parts)} parts do not make groups of {self.group}")
        groups = [torch.cat(parts[i:i + self.group], dim=self.dim) for i in range(0, len(parts), self.group)]
        return torch.stack(groups, dim=0)


Combine = Single | Concat | Stack | StackGroups


@dataclass(frozen=True)
class Recipe:
    """One engine tensor = combine(transform(part) for each part), then cast to the engine dtype."""

    parts: tuple[str, ...]
    combine: Combine = Single()
    transform: PartTransform | None = None

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a recipe needs at least one part")
        if isinstance(self.combine, Single) and len(self.parts) != 1:
            raise ValueError(f"a single-part recipe got {len(self.parts)} parts: {self.parts}")

    def make(self, engine_name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The engine tensor, reading each part with `read(part_name)`; in the parts' dtype."""
        parts = [read(name) for name in self.parts]
        if self.transform is not None:
            parts = [self.transform(engine_name, name, t) for name, t in zip(self.parts, parts)]
        return self.combine(parts)

    def expected_shape(self, engine_name: str, part_shapes: Sequence[tuple[int, ...]],
                       part_dtypes: Sequence[torch.dtype] | None = None) -> tuple[int, ...] | None:
        """The shape `make` would give for parts of these shapes (and dtypes), or None when they do not
        combine. Runs the transform and combine on meta tensors, so it holds for any of them and reads
        no data."""
        dtypes = part_dtypes or [torch.float32] * len(part_shapes)
        try:
            meta = {name: torch.empty(shape, dtype=dtype, device="meta")
                    for name, shape, dtype in zip(self.parts, part_shapes, dtypes, strict=True)}
            return tuple(self.make(engine_name, meta.__getitem__).shape)
        except (RuntimeError, ValueError, IndexError):
            return None


# Fused kiln module -> the checkpoint modules it is made of, in the row order the layers expect
# (`Attention.split_sizes`, `silu_and_mul`).
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def fused_recipe(engine_name: str) -> Recipe:
    """'model.layers.0.self_attn.qkv_proj.weight' -> (…q_proj.weight, …k_proj.weight, …v_proj.weight)
    concatenated along dim 0 (weights and biases alike); any other name is its own checkpoint tensor."""
    path = engine_name.split(".")
    for i, module in enumerate(path):
        if module in FUSED_MODULES:
            parts = tuple(".".join([*path[:i], src, *path[i + 1:]]) for src in FUSED_MODULES[module])
            return Recipe(parts, Concat(0))
    return Recipe((engine_name,))


def fused_recipes(config: ModelConfig, engine_names: Iterable[str]) -> dict[str, Recipe]:
    """The Llama family's recipes: q/k/v and gate/up fused by rows, everything else copied by name."""
    return {name: fused_recipe(name) for name in engine_names}


def consumed_parts(recipes: Iterable[Recipe]) -> set[str]:
    """Every checkpoint tensor some recipe reads; the rest of the checkpoint goes unused."""
    return {part for recipe in recipes for part in recipe.parts}
