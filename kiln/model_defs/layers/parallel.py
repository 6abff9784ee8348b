"""Tensor parallelism inside a network: which share of a layer's features a rank holds, and the collectives
that put the shares back together.

A sharded layer records a `FeatureShard` (the builder's sharder reads it to cut each engine tensor from the
whole one; the runtime never cuts anything, it loads its rank file). The collectives come from a `TPComm`
that the runtime makes over torch.distributed (`kiln.runtime.distributed`); the builder builds ranks'
networks on the meta device without one, and never runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from kiln.engine_format.mapping import Mapping


class TPComm(Protocol):
    """The collectives of one tensor-parallel group, as a network's layers call them."""

    tp_size: int
    tp_rank: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over ranks (x may be overwritten; use the result)."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, C] on each rank -> [N, tp_size * C], rank 0's columns first."""
        ...


@dataclass(frozen=True)
class FeatureShard:
    """This rank's features along one dim of a layer: `output` (column-parallel, vocab) or `input` (row).

    `full_sizes` are the whole layer's parts along that dim ([q, k, v] rows; one part when unfused) and
    `slices` this rank's (start, length) inside each part. A slice may run past its part's end only for a
    vocabulary padded to a multiple of tp_size: those rows are zeros."""

    dim: Literal["output", "input"]
    full_sizes: tuple[int, ...]
    slices: tuple[tuple[int, int], ...]

    @property
    def local_sizes(self) -> tuple[int, ...]:
        return tuple(length for _, length in self.slices)

    def ranges(self) -> list[tuple[int, int]]:
        """(start, end) of each slice in the whole layer's feature numbering (parts laid end to end)."""
        out, offset = [], 0
        for size, (start, length) in zip(self.full_sizes, self.slices, strict=True):
            out.append((offset + start, offset + start + length))
            offset += size
        return out


def even_shard(dim: Literal["output", "input"], sizes: tuple[int, ...], mapping: Mapping, prefix: str) -> FeatureShard:
    """Rank r gets the r-th 1/tp_size of every part; a ValueError names the layer and the part that does not split."""
    tp, rank = mapping.tp_size, mapping.tp_rank
    for size in sizes:
        if size % tp:
            raise ValueError(f"{prefix}: {dim} features {size} (parts {list(sizes)}) are not divisible by "
                             f"tp_size={tp}; choose a --tp-size that divides them")
    return FeatureShard(dim, sizes, tuple((rank * (s // tp), s // tp) for s in sizes))


def head_shard(num_heads: int, num_kv_heads: int, head_dim: int, mapping: Mapping) -> FeatureShard:
    """The fused [q; k; v] rows of this rank's heads: its share of the query heads, and its share of the KV
    heads or, when there are fewer KV heads than ranks, the one KV head its query heads read (replicated)."""
    mapping.check_heads(num_heads, num_kv_heads)
    tp, rank = mapping.tp_size, mapping.tp_rank
    q_heads, kv_heads = num_heads // tp, mapping.kv_heads_per_rank(num_kv_heads)
    kv_start = rank * kv_heads if num_kv_heads >= tp else rank * num_kv_heads // tp
    q_slice, kv_slice = (rank * q_heads * head_dim, q_heads * head_dim), (kv_start * head_dim, kv_heads * head_dim)
    sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
    return FeatureShard("output", sizes, (q_slice, kv_slice, kv_slice))


def vocab_shard(vocab_size: int, mapping: Mapping) -> FeatureShard:
    """Rank r's rows of a vocabulary padded up to a multiple of tp_size (padding rows are zeros, their
    logits dropped after the gather)."""
    per_rank = -(-vocab_size // mapping.tp_size)
    return FeatureShard("output", (vocab_size,), ((mapping.tp_rank * per_rank, per_rank),))


class VocabParallelEmbedding(nn.Module):
    """token ids [T] -> [T, H]. With tp_size > 1 each rank holds `shard`'s rows of the table, looks up the ids
    that fall in them (zeros elsewhere) and the all-reduce sums the ranks' rows. The parameter is `weight`
    either way, so the engine tensor keeps nn.Embedding's name."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, mapping: Mapping | None,
                 comm: TPComm | None) -> None:
        super().__init__()
        self.shard = None if mapping is None or mapping.tp_size == 1 else vocab_shard(vocab_size, mapping)
        rows = vocab_size if self.shard is None else self.shard.local_sizes[0]
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype))
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return F.embedding(input_ids, self.weight)  # [T, H]
        start, rows = self.shard.slices[0]
        local = input_ids - start  # [T]
        outside = (local < 0) | (local >= rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
        return require_comm(self.comm, "the embedding").all_reduce(x.masked_fill(outside[:, None], 0))


def require_comm(comm: TPComm | None, what: str) -> TPComm:
    if comm is None:
        raise RuntimeError(f"{what} is tensor-parallel but its network was built without a TPComm (the builder's "
                           f"meta networks never run); load the engine with kiln.runtime")
    return comm


def gather_vocab(comm: TPComm | None, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """This rank's logits [N, V_pad / tp] -> every rank's, [N, V] (the padding columns dropped)."""
    return require_comm(comm, "the lm_head").all_gather(logits)[:, :vocab_size]
