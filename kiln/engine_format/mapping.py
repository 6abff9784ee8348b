"""How an engine's weights are split over ranks (plain Python, no torch).

One rank per tensor-parallel shard today; pipeline stages would multiply `num_ranks` later. The builder
writes `Mapping.to_dict()` into engine.json; the runtime reads it back once with `Mapping.from_dict`, and
each rank's network is built with its own `tp_rank`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Mapping:
    """`tp_size` ranks each hold 1/tp_size of every sharded layer; `tp_rank` is the one this process runs."""

    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size!r} must be a positive integer")
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank!r} must be in [0, tp_size={self.tp_size})")

    @property
    def num_ranks(self) -> int:
        return self.tp_size

    def kv_heads_per_rank(self, num_kv_heads: int) -> int:
        """KV heads each rank holds: its share, or one replicated head when there are fewer KV heads than ranks
        (TensorRT-LLM's and vLLM's rule)."""
        return max(1, num_kv_heads // self.tp_size)

    def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """ValueError unless every rank gets whole query heads and whole (or whole replicated) KV heads."""
        tp = self.tp_size
        if num_heads % tp:
            raise ValueError(f"num_attention_heads={num_heads} is not divisible by tp_size={tp}: each rank needs "
                             f"whole heads; choose a --tp-size that divides {num_heads}")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"num_key_value_heads={num_kv_heads} and tp_size={tp}: one must divide the other (KV "
                             f"heads are split over ranks, or replicated when fewer than ranks)")

    def for_rank(self, rank: int) -> Mapping:
        """The same mapping as seen by `rank`."""
        return replace(self, tp_rank=rank)

    def to_dict(self) -> dict[str, int]:
        """engine.json's `mapping` (no rank: the file describes all of them)."""
        return {"tp_size": self.tp_size, "num_ranks": self.num_ranks}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Mapping:
        """engine.json's `mapping`; raises ValueError naming the key at fault."""
        tp_size = d.get("tp_size")
        mapping = cls(tp_size=tp_size)  # validates tp_size
        if d.get("num_ranks") != mapping.num_ranks:
            raise ValueError(f"num_ranks={d.get('num_ranks')!r} must equal tp_size={tp_size}")
        return mapping
