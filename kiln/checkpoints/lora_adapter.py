"""A LoRA adapter laid out on kiln's layers: per fused linear, per part, the A and B factors; its reference
delta; and a tensor-parallel rank's slice of it.

kiln fuses q/k/v into `qkv_proj` (rows [q | k | v]) and gate/up into `gate_up_proj` (rows [gate | up])
(`model_defs/recipes.py`, FUSED_MODULES); `o_proj` and `down_proj` are single. A Hugging Face adapter has one
(A, B) per unfused module, so a fused linear keeps one `LoRAPart` per part in the layer's row order, None where
the adapter leaves that part alone. A part's delta is x @ A^T @ B^T; a fused linear's delta is its parts'
deltas laid side by side (zeros for absent parts), which is what the layer's output gains.

The scaling (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA) is folded into B when the adapter is read,
so the runtime's operator computes one product per part and never needs the alpha (vLLM does the same);
`LoRAPart.scaling` keeps the value that was folded, for reports. Factors are float32 whatever the file's
dtype: the runtime casts them to the engine's dtype when it puts them in a device slot.

Tensor parallelism follows the base layers (`model_defs/layers/parallel.py`, `LinearFactory`): column-parallel
linears (qkv_proj by whole heads, KV heads replicated below tp_size; gate_up_proj evenly per part) give each
rank its rows of B per part and the whole A; row-parallel ones (o_proj, down_proj) its columns of A and the
whole B, the ranks' partial deltas summed by the layer's all-reduce.
"""

from __future__ import annotations

from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

import torch

from kiln.engine_format.mapping import Mapping
from kiln.model_defs.config import ModelConfig
from kiln.model_defs.layers.parallel import FeatureShard, even_shard, head_shard


class LoRAError(ValueError):
    """An adapter kiln cannot serve; the message names the file, field or tensor, its value and the limit."""


@dataclass(frozen=True, eq=False)
class LoRAPart:
    """One unfused module's factors: a [r, in_features], b [out_part, r] with the scaling folded in."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float  # already in b; kept for reports

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out_part]."""
        return (x @ self.a.to(x.dtype).T) @ self.b.to(x.dtype).T


@dataclass(frozen=True, eq=False)
class LoRALinear:
    """The adapter on one of kiln's linears (`prefix`, e.g. "model.layers.0.self_attn.qkv_proj").

    `part_names` are the unfused modules in row order (("q_proj", "k_proj", "v_proj") for qkv_proj),
    `out_sizes` their rows, `parts` their factors (None: not adapted). On a tensor-parallel rank the sizes
    are the rank's and `shard` says which of the whole layer's features they are (as `Linear.shard`)."""

    prefix: str
    parallel: Literal["column", "row"]
    in_features: int
    part_names: tuple[str, ...]
    out_sizes: tuple[int, ...]
    parts: tuple[LoRAPart | None, ...]
    shard: FeatureShard | None = None

    @property
    def out_features(self) -> int:
        return sum(self.out_sizes)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The reference product: x [T, in_features] -> [T, out_features], what the adapter adds to the
        layer's output (zeros in the rows of absent parts)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.prefix}: input has {x.shape[-1]} features, the adapter expects {self.in_features}")
        pieces = [part.delta(x) if part is not None else x.new_zeros(x.shape[0], size)
                  for part, size in zip(self.parts, self.out_sizes, strict=True)]
        return torch.cat(pieces, dim=-1)


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A PEFT LoRA adapter mapped onto kiln's linears, keyed by their module path (`Linear.prefix`); a linear
    the adapter does not touch has no entry. `rank` is the largest rank of any part (rank_pattern may give
    modules different ranks); `tp_rank`/`tp_size` say which slice this is (0 / 1: the whole adapter)."""

    name: str
    path: str
    rank: int
    linears: MappingABC[str, LoRALinear] = field(default_factory=dict)
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "linears", MappingProxyType(dict(self.linears)))

    def get(self, prefix: str) -> LoRALinear | None:
        """The adapter on the linear at module path `prefix`, or None when it leaves that linear alone."""
        return self.linears.get(prefix)


def base_shard(linear: LoRALinear, config: ModelConfig, mapping: Mapping) -> FeatureShard:
    """The base layer's shard on `mapping`'s rank, made as LinearFactory makes it (so the two never differ)."""
    if linear.prefix.endswith(".qkv_proj"):
        return head_shard(config.num_heads, config.num_kv_heads, config.head_dim, mapping)
    if linear.parallel == "column":
        return even_shard("output", linear.out_sizes, mapping, linear.prefix)
    return even_shard("input", (linear.in_features,), mapping, linear.prefix)


def shard_linear(linear: LoRALinear, shard: FeatureShard) -> LoRALinear:
    """The slice of a whole linear's adapter that the rank holding `shard` of the base layer needs."""
    if shard.dim == "output":
        if linear.parallel != "column" or shard.full_sizes != linear.out_sizes:
            raise LoRAError(f"{linear.prefix}: shard of output parts {list(shard.full_sizes)} does not fit the "
                            f"adapter's {linear.parallel} linear of parts {list(linear.out_sizes)}")
        parts = tuple(None if part is None else replace(part, b=part.b[start:start + length].contiguous())
                      for part, (start, length) in zip(linear.parts, shard.slices, strict=True))
        return replace(linear, out_sizes=shard.local_sizes, parts=parts, shard=shard)
    if linear.parallel != "row" or shard.full_sizes != (linear.in_features,):
        raise LoRAError(f"{linear.prefix}: shard of input features {list(shard.full_sizes)} does not fit the "
                        f"adapter's {linear.parallel} linear of {linear.in_features} input features")
    ((start, length),) = shard.slices
    parts = tuple(None if part is None else replace(part, a=part.a[:, start:start + length].contiguous())
                  for part in linear.parts)
    return replace(linear, in_features=length, parts=parts, shard=shard)


def shard_adapter(adapter: LoRAAdapter, config: ModelConfig, mapping: Mapping) -> LoRAAdapter:
    """`mapping.tp_rank`'s slice of a whole adapter, for an engine built with `mapping.tp_size` ranks."""
    if adapter.tp_size != 1:
        raise LoRAError(f"adapter {adapter.name!r} is already rank {adapter.tp_rank}'s slice of {adapter.tp_size}")
    if mapping.tp_size == 1:
        return adapter
    linears = {prefix: shard_linear(linear, base_shard(linear, config, mapping))
               for prefix, linear in adapter.linears.items()}
    return replace(adapter, linears=linears, tp_rank=mapping.tp_rank, tp_size=mapping.tp_size)
