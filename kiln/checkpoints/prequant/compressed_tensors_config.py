"""config.json's `quantization_config` of a compressed-tensors checkpoint, read into the one kiln scheme its
quantized layers have (`parse_scheme`, `parse_kv_cache`) and the checkpoint modules it quantizes
(`linear_layers`, `select_modules`): the half of compressed_tensors.py's reader that needs no tensor data.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.model_defs import build_network, model_def_for_hf_config
from kiln.model_defs.layers.linear import Linear
from kiln.model_defs.recipes import Concat, Single
from kiln.quant.base import QuantError

PLAIN_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")  # codes in their torch dtype
PACKED_FORMAT = "pack-quantized"
SUPPORTED = ("FP8 W8A8 with per-tensor or per-channel weight scales and a static per-tensor (-> fp8) or dynamic "
             "per-token (-> fp8_dynamic) input scale; FP8 block-scaled weights with dynamic per-token-group "
             "inputs (-> fp8_block); INT8 W8A8 with per-tensor or per-channel weight scales and a dynamic "
             "per-token (-> int8_dynamic) or static per-tensor (-> int8_sq) input scale; INT4 / INT8 "
             "weight-only, per group or per channel, symmetric or asymmetric (-> weight_only); all symmetric "
             "activations, one scheme for every quantized layer, formats float-quantized, int-quantized, "
             "naive-quantized and pack-quantized, an optional FP8 per-tensor kv_cache_scheme")


@dataclass(frozen=True)
class Args:
    """A compressed-tensors QuantizationArgs, with its defaults filled in as compressed-tensors does."""

    num_bits: int
    type: str  # "int" | "float"
    symmetric: bool
    strategy: str  # tensor | channel | group | block | token | ...
    group_size: int | None
    block_structure: tuple[int, int] | None
    dynamic: bool | str
    actorder: str | None

    def describe(self) -> str:
        """e.g. "int4 per group of 32, asymmetric", "float8 per token, dynamic"."""
        scope = {"group": f"group of {self.group_size}", "block": f"{list(self.block_structure or ())} block"}
        what = f"{self.type}{self.num_bits} per {scope.get(self.strategy, self.strategy)}"
        return what + (", asymmetric" if not self.symmetric else "") + (", dynamic" if self.dynamic else "")


@dataclass(frozen=True)
class Scheme:
    """One kiln scheme and how the checkpoint stores its weights."""

    qformat: str
    weights: Args
    inputs: Args | None
    storage: str  # the compression format: pack-quantized, or one that keeps the codes in `weight`
    block_size: tuple[int, int] | None = None

    @property
    def packed(self) -> bool:
        """weight_packed int32 + weight_shape, rather than the codes in `weight`."""
        return self.storage == PACKED_FORMAT

    @property
    def static_input(self) -> bool:
        return self.qformat in ("fp8", "int8_sq")

    @property
    def zero_point(self) -> bool:
        return not self.weights.symmetric


# --- the scheme ----------------------------------------------------------------------------------------

def _parse_args(field: str, value: Any) -> Args:
    """QuantizationArgs' defaults and strategy inference (num_bits 8, int, symmetric, static, per tensor
    without a group size, per group with one, per channel with -1)."""
    if not isinstance(value, dict):
        raise QuantError(f"{field}={value!r:.80} must be an object of quantization args")
    num_bits, qtype = value.get("num_bits", 8), str(value.get("type", "int")).lower()
    group_size, strategy = value.get("group_size"), value.get("strategy")
    strategy = str(strategy).lower() if strategy is not None else (
        "tensor" if group_size is None else "channel" if group_size == -1 else "group")
    block = value.get("block_structure")
    if isinstance(block, str):  # older configs: "128x128"
        block = [int(b) for b in block.split("x")]
    if not isinstance(num_bits, int) or qtype not in ("int", "float"):
        raise QuantError(f"{field}: num_bits={num_bits!r}, type={qtype!r} are not quantization args kiln reads")
    dynamic = value.get("dynamic", False)
    actorder = value.get("actorder")
    return Args(num_bits, qtype, bool(value.get("symmetric", True)), strategy,
                group_size if strategy == "group" else None, tuple(block) if block else None,
                dynamic.lower() if isinstance(dynamic, str) else bool(dynamic),
                None if actorder in (None, False) else str(actorder).lower())


def parse_scheme(where: str, config: dict) -> tuple[Scheme, list[str]]:
    """The one kiln scheme of every config group, and the groups' targets together."""
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantError(f"{where}.config_groups={groups!r:.80} must name at least one group of quantized layers")
    schemes: dict[str, Scheme] = {}
    targets: list[str] = []
    for name, group in groups.items():
        field = f"{where}.config_groups.{name}"
        if not isinstance(group, dict):
            raise QuantError(f"{field}={group!r:.80} is a preset name with targets; kiln reads the expanded scheme "
                             f"(weights, input_activations), as llm-compressor saves it")
        if group.get("output_activations") is not None:
            raise QuantError(f"{field}.output_activations is set: kiln quantizes no layer outputs. kiln reads: "
                             f"{SUPPORTED}")
        fmt = group.get("format") or config.get("format")
        schemes[name] = _group_scheme(field, group, fmt)
        group_targets = group.get("targets")
        if not isinstance(group_targets, list) or not all(isinstance(t, str) for t in group_targets):
            raise QuantError(f"{field}.targets={group_targets!r:.80} must be a list of module names, 're:' patterns "
                             f"or 'Linear'")
        targets += group_targets
    (first, scheme), *rest = schemes.items()
    for name, other in rest:
        if other != scheme:
            raise QuantError(f"{where}.config_groups: {first} ({scheme.qformat}: {scheme.weights.describe()}) and {name} "
                             f"({other.qformat}: {other.weights.describe()}) quantize layers differently; a kiln "
                             f"engine has one scheme for every quantized layer")
    return scheme, targets


def _group_scheme(field: str, group: dict, fmt: str | None) -> Scheme:
    if group.get("weights") is None:
        raise QuantError(f"{field}.weights is null (activation or attention quantization only); kiln reads: "
                         f"{SUPPORTED}")
    w = _parse_args(f"{field}.weights", group["weights"])
    a = None if group.get("input_activations") is None else _parse_args(f"{field}.input_activations",
                                                                        group["input_activations"])
    if fmt not in (*PLAIN_FORMATS, PACKED_FORMAT):
        raise QuantError(f"{field}: format={fmt!r} is not a compressed-tensors layout kiln reads "
                         f"({', '.join((*PLAIN_FORMATS, PACKED_FORMAT))})")
    if w.actorder == "group" or w.actorder == "dynamic":
        raise QuantError(f"{field}.weights.actorder={w.actorder!r} (a g_idx per input column) is not read by kiln; "
                         f"actorder 'weight' (or none) is")
    if w.dynamic:
        raise QuantError(f"{field}.weights.dynamic={w.dynamic!r}: kiln reads weights with stored scales only")
    if fmt == PACKED_FORMAT and w.type != "int":
        raise QuantError(f"{field}: format pack-quantized with {w.type} weights is not a layout kiln reads")

    def refuse(what: str) -> QuantError:
        return QuantError(f"{field}: {what} has no kiln scheme; kiln reads: {SUPPORTED}")

    if a is None:  # weight-only
        if w.type != "int" or w.num_bits not in (4, 8):
            raise refuse(f"weights.type={w.type!r} num_bits={w.num_bits} weight-only")
        if w.strategy not in ("group", "channel"):
            raise refuse(f"weight-only weights.strategy={w.strategy!r}")
        if w.strategy == "group" and (not isinstance(w.group_size, int) or w.group_size < 2 or w.group_size % 2):
            raise refuse(f"weights.group_size={w.group_size!r}")
        return Scheme("weight_only", w, None, fmt)
    if not a.symmetric:
        raise refuse("input_activations.symmetric=false (activation zero points)")
    if w.num_bits != 8 or a.num_bits != 8 or w.type != a.type or not w.symmetric:
        raise refuse(f"weights {w.describe()} with input_activations {a.describe()}")
    if w.type == "float" and w.strategy == "block":
        block = w.block_structure
        if block is None or len(block) != 2 or a.strategy != "group" or a.dynamic is not True \
                or a.group_size != block[1]:
            raise refuse(f"block-scaled FP8 weights {w.describe()} with input_activations {a.describe()} (kiln's "
                         f"fp8_block takes dynamic per-token groups as wide as the weight block)")
        return Scheme("fp8_block", w, a, fmt, block_size=(int(block[0]), int(block[1])))
    if w.strategy not in ("tensor", "channel"):
        raise refuse(f"W8A8 weights.strategy={w.strategy!r}")
    if a.strategy == "token" and a.dynamic is True:
        return Scheme("fp8_dynamic" if w.type == "float" else "int8_dynamic", w, a, fmt)
    if a.strategy == "tensor" and a.dynamic is False:
        return Scheme("fp8" if w.type == "float" else "int8_sq", w, a, fmt)
    raise refuse(f"input_activations {a.describe()}")


def parse_kv_cache(where: str, value: Any) -> str | None:
    if value is None:
        return None
    kv = _parse_args(f"{where}.kv_cache_scheme", value)
    if (kv.type, kv.num_bits, kv.strategy, kv.symmetric, kv.dynamic) != ("float", 8, "tensor", True, False):
        raise QuantError(f"{where}.kv_cache_scheme ({kv.describe()}) is not one kiln reads: kiln reads a static, "
                         f"symmetric FP8 scale per layer for K and for V (strategy 'tensor')")
    return "fp8"


# --- which layers are quantized ------------------------------------------------------------------------

def read_config(checkpoint: Path) -> dict[str, Any]:
    try:
        return json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise QuantError(f"cannot read {checkpoint / 'config.json'}: {e}") from None


def linear_layers(checkpoint: Path, raw: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """The kiln network's linear layers (engine prefixes, e.g. "model.layers.0.self_attn.qkv_proj") and the
    checkpoint modules each is made of, in row order, from the float network's recipes."""
    try:
        model_def = model_def_for_hf_config(raw)
        config = model_def.parse_config(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise QuantError(f"{checkpoint / 'config.json'}: {e}") from None
    with torch.device("meta"):
        model = build_network(model_def, config, None, dtype=torch.float32)
    prefixes = [name for name, m in model.named_modules() if isinstance(m, Linear)]
    recipes = model_def.recipes(config, [f"{p}.weight" for p in prefixes])
    layers = {}
    for prefix in prefixes:
        recipe = recipes[f"{prefix}.weight"]
        if not isinstance(recipe.combine, Single | Concat) or (isinstance(recipe.combine, Concat)
                                                               and recipe.combine.dim != 0):
            raise QuantError(f"{prefix}.weight: a weight made by {recipe.combine} cannot be read from a quantized "
                             f"checkpoint yet")
        layers[prefix] = tuple(part.removesuffix(".weight") for part in recipe.parts)
    return layers


def _matches(module: str, pattern: str) -> bool:
    """compressed-tensors' match_name plus its class match for "Linear" (every module of a kiln linear layer
    is an nn.Linear in the checkpoint's model)."""
    if pattern.startswith("re:"):
        return re.match(pattern.removeprefix("re:"), module) is not None
    return pattern in (module, "Linear")


def select_modules(where: str, layers: dict[str, tuple[str, ...]], targets: list[str], ignore: list[str],
            names: set[str]) -> tuple[set[str], tuple[str, ...]]:
    """(the checkpoint modules stored quantized, the engine layers to leave unquantized as exclude patterns).
    A module is quantized when a target matches it and no ignore entry does; the tensors must agree, and the
    parts of a fused layer must all be quantized or all not."""
    modules = {m for parts in layers.values() for m in parts}
    for t in targets:
        if not t.startswith("re:") and t != "Linear" and t not in modules:
            raise QuantError(f"{where}: targets entry {t!r} is neither 'Linear', a 're:' pattern nor a linear "
                             f"module of the model; kiln cannot tell which layers it quantizes")
    quantized, excluded = set(), []
    for prefix, parts in layers.items():
        flags = []
        for m in parts:
            ignored_by = next((i for i in ignore if _matches(m, i)), None)
            configured = ignored_by is None and any(_matches(m, t) for t in targets)
            stored = f"{m}.weight_scale" in names
            if configured != stored:
                why = f"ignore entry {ignored_by!r}" if ignored_by else "targets" if configured else "no target"
                raise QuantError(f"{where} {'quantizes' if configured else 'leaves unquantized'} {m} ({why}), but the "
                                 f"checkpoint stores it {'quantized' if stored else 'unquantized'}")
            flags.append(configured)
        if all(flags):
            quantized.update(parts)
        elif not any(flags):
            excluded.append(prefix)
        else:
            left = [m for m, f in zip(parts, flags) if not f]
            raise QuantError(f"{where}.ignore leaves {', '.join(left)} unquantized but not the rest of {prefix} "
                             f"({', '.join(parts)}), which kiln fuses into one layer of one precision")
    return quantized, _patterns(excluded, list(layers))


def _patterns(excluded: list[str], layers: list[str]) -> tuple[str, ...]:
    """The excluded engine layers as fnmatch patterns: one per layer, or one with "*" for the layer index
    where every decoder layer's instance is excluded ("model.layers.*.mlp.down_proj")."""
    out: list[str] = []
    for prefix in excluded:
        wildcard = re.sub(r"\.\d+\.", ".*.", prefix, count=1)
        covered = [p for p in layers if fnmatch.fnmatchcase(p, wildcard)]
        pattern = wildcard if all(p in excluded for p in covered) else prefix
        if pattern not in out:
            out.append(pattern)
    return tuple(out)

