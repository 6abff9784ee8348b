"""Cutting whole engine tensors into each tensor-parallel rank's share, generically.

The producer makes every engine tensor whole, as for tp_size 1: checkpoint recipes, quantization and the
pre-quantized checkpoint readers know nothing of ranks. Each rank's network, built once on the meta device,
says what that rank stores: every tensor's shape and dtype, and for each sharded layer which of the whole
layer's features it holds (`FeatureShard`). From these alone a `TensorCut` is planned per rank and tensor
before any weight is read, so a split that would cut a quantization group fails before calibration.

A tensor whose rank shape equals the whole shape is replicated (norms, per-tensor scales, a column layer's
pre_quant_scale), except a row-parallel layer's bias: the ranks' outputs are summed, so rank 0 keeps it and
the others store zeros. Otherwise exactly one dim d differs, and along it the tensor holds
f = whole.shape[d] / sum(shard.full_sizes) entries per feature (1 for a weight, 1/2 for INT4 packed along
the input, 1/group for group scales): the shard's feature range [start, end) is the index range
[start * f, end * f), which must be whole numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.model_defs import build_network
from kiln.model_defs.layers.parallel import FeatureShard

from .safetensors_writer import TensorSpec, specs_of

if TYPE_CHECKING:
    from kiln.engine_format import Mapping
    from kiln.model_defs import ModelConfig, ModelDef
    from kiln.quant.base import QuantConfig


class ShardingError(ValueError):
    """A model or quantization that cannot be split over the asked ranks; names the layer, tensor and sizes."""


@dataclass(frozen=True)
class TensorCut:
    """How one rank's tensor comes from the whole one. `dim` None: the whole tensor (all zeros when `zeros`).
    Otherwise the whole tensor's index `ranges` along `dim`, concatenated; indices past its end read as zeros
    (a vocabulary padded to a multiple of tp_size)."""

    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    zeros: bool = False

    def apply(self, whole: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return torch.zeros_like(whole) if self.zeros else whole
        size, pieces = whole.shape[self.dim], []
        for start, end in self.ranges:
            if start < size:
                pieces.append(whole.narrow(self.dim, start, min(end, size) - start))
            if end > size:
                padding = list(whole.shape)
                padding[self.dim] = end - max(start, size)
                pieces.append(whole.new_zeros(padding))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


@dataclass(frozen=True)
class RankSharder:
    """Every rank's tensors (`rank_specs[r]`: the whole specs' names in their order, rank r's shapes) and how
    each is cut from the whole tensor."""

    rank_specs: tuple[tuple[TensorSpec, ...], ...]
    cuts: tuple[dict[str, TensorCut], ...]

    @property
    def num_ranks(self) -> int:
        return len(self.rank_specs)

    def cut(self, name: str, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s tensor `name` from the whole (tp_size 1) tensor: a view where it can be one."""
        return self.cuts[rank][name].apply(whole)


def plan_sharding(model_def: ModelDef, config: ModelConfig, quant: QuantConfig | None, mapping: Mapping,
                  specs: Sequence[TensorSpec], *, dtype: torch.dtype) -> RankSharder:
    """The cuts of the whole engine tensors `specs` (the tp_size 1 network's) for every rank of `mapping`,
    from each rank's network built on the meta device. Raises ShardingError, before any weight is read, for
    heads or features that do not split over tp_size and for cuts through a quantization group."""
    if mapping.tp_size == 1:
        return RankSharder((tuple(specs),), ({spec.name: TensorCut() for spec in specs},))
    rank_specs, cuts = [], []
    for rank in range(mapping.tp_size):
        try:
            with torch.device("meta"):
                network = build_network(model_def, config, quant, mapping.for_rank(rank), dtype=dtype)
        except ValueError as e:  # heads or features that tp_size does not divide (Mapping, even_shard)
            raise ShardingError(f"--tp-size {mapping.tp_size}: {e}") from None
        mine = specs_of(network.state_dict())
        _check_same_tensors(specs, mine, rank)
        rank_specs.append(tuple(mine))
        cuts.append({whole.name: _plan_cut(network, whole, ours, rank, mapping.tp_size)
                     for whole, ours in zip(specs, mine, strict=True)})
    return RankSharder(tuple(rank_specs), tuple(cuts))


def _check_same_tensors(whole: Sequence[TensorSpec], mine: Sequence[TensorSpec], rank: int) -> None:
    """Every rank stores the whole network's tensors, by the same names, in the same order and dtypes."""
    if [s.name for s in whole] != [s.name for s in mine]:
        differ = sorted({s.name for s in whole} ^ {s.name for s in mine})[:3] or ["their order"]
        raise ShardingError(f"rank {rank}'s network has other tensors than the whole network's (e.g. "
                            f"{', '.join(differ)}); its layers must declare the same tensors on every rank")
    for w, m in zip(whole, mine, strict=True):
        if w.dtype != m.dtype or len(w.shape) != len(m.shape):
            raise ShardingError(f"{w.name}: rank {rank} stores {m.dtype} {list(m.shape)}, the whole network "
                                f"{w.dtype} {list(w.shape)}; only the size of one dim may differ")


def _plan_cut(network: nn.Module, whole: TensorSpec, mine: TensorSpec, rank: int, tp: int) -> TensorCut:
    path, _, attr = whole.name.rpartition(".")
    layer = network.get_submodule(path)
    if mine.shape == whole.shape:
        # A row layer's outputs are summed over ranks: its bias must be added once.
        row_bias = attr == "bias" and getattr(layer, "parallel", None) == "row"
        return TensorCut(zeros=row_bias and rank > 0)
    dims = [d for d, (w, m) in enumerate(zip(whole.shape, mine.shape, strict=True)) if w != m]
    shard: FeatureShard | None = getattr(layer, "shard", None)
    if len(dims) != 1 or shard is None:
        why = "more than one dim differs" if len(dims) != 1 else f"its layer {path} records no FeatureShard"
        raise ShardingError(f"{whole.name}: rank {rank} stores {list(mine.shape)} of the whole {list(whole.shape)}, "
                            f"but {why}; kiln cannot cut it")
    if attr == "g_idx" and shard.dim == "input":
        raise ShardingError(
            f"{path}: cannot split g_idx over --tp-size {tp}: a GPTQ act-order (desc_act) layer's g_idx names the "
            f"group of each input column among the whole layer's groups, so its input features cannot be split "
            f"over ranks; build with --tp-size 1, or from a checkpoint quantized without desc_act")
    dim = dims[0]
    if not _proportional(layer, attr, shard, dim, whole.shape[dim]):
        raise ShardingError(
            f"{path}: cannot split {attr} {list(whole.shape)} over --tp-size {tp}: its {whole.shape[dim]} entries along "
            f"dim {dim} do not grow in proportion to the layer's {sum(shard.full_sizes)} {shard.dim} features (a last "
            f"partial quantization block: the features are not a multiple of the block size), so rank {rank}'s "
            f"features {shard.ranges()} do not start on whole blocks; build with --tp-size 1")
    per_feature = Fraction(whole.shape[dim], sum(shard.full_sizes))
    ranges = []
    for start, end in shard.ranges():
        first, last = start * per_feature, end * per_feature
        if first.denominator != 1 or last.denominator != 1:
            raise ShardingError(_cuts_a_group(path, attr, whole, shard, per_feature, rank, tp, (start, end)))
        ranges.append((int(first), int(last)))
    if sum(last - first for first, last in ranges) != mine.shape[dim]:
        raise ShardingError(f"{whole.name}: rank {rank}'s {shard.dim} features {shard.ranges()} are "
                            f"{sum(last - first for first, last in ranges)} entries along dim {dim} of the whole "
                            f"{list(whole.shape)}, but its network stores {mine.shape[dim]}; kiln cannot cut it")
    return TensorCut(dim, tuple(ranges))


def _proportional(layer: nn.Module, attr: str, shard: FeatureShard, dim: int, whole_size: int) -> bool:
    """Whether the layer's method declares k times the entries along `dim` for k times the features along the
    shard's dim, with k = the feature count itself, so that a last partial block (ceil(features / block)
    entries) shows even where whole / rank shapes look proportional. A layer without a linear method (the
    embedding) holds one row per feature."""
    method = getattr(layer, "method", None)
    if method is None:
        return True
    features = sum(shard.full_sizes)
    in_features = features * features if shard.dim == "input" else layer.in_features
    out_features = features * features if shard.dim == "output" else layer.out_features
    decls = method.layer_tensors(layer, in_features, out_features, getattr(layer, "bias", None) is not None)
    return attr in decls and decls[attr].shape[dim] == whole_size * features


def _cuts_a_group(layer: str, tensor: str, whole: TensorSpec, shard: FeatureShard, per_feature: Fraction,
                  rank: int, tp: int, features: tuple[int, int]) -> str:
    """Which rank's features would cut which group, and the --tp-size (or --awq-block-size) that would not."""
    unit = 1 / per_feature  # features per entry: a group size, or 2 for packed INT4
    message = (f"{layer}: cannot split {tensor} {list(whole.shape)} over --tp-size {tp}: it holds one entry per "
               f"{unit} {shard.dim} features (a quantization group or packed unit), and rank {rank}'s "
               f"{shard.dim} features [{features[0]}, {features[1]}) would cut one")
    sizes = " and ".join(str(size) for size in dict.fromkeys(shard.full_sizes))
    if unit.denominator == 1:
        units = math.gcd(*shard.full_sizes) // int(unit)  # whole units in every part
        fits = [str(t) for t in range(2, units + 1) if units % t == 0][:3]
        example = f"e.g. {', '.join(fits)}" if fits else "no --tp-size above 1 does"
        message += f"; use a --tp-size for which {sizes} / tp_size is a multiple of {unit} ({example})"
    if shard.dim == "input":
        message += f", or (int4_awq, int4_wo) an --awq-block-size that divides {shard.local_sizes[0]}"
    return message
