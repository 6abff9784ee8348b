"""config.json `quantization_config.quant_method = "fp8"`: transformers' FineGrainedFP8 layout, the format of
DeepSeek-V3's and Qwen3's FP8 releases (`Qwen/Qwen3-8B-FP8`), read exactly.

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
     "modules_to_not_convert": [...] (or "ignored_layers")}

With `weight_block_size` [b0, b1] each quantized linear stores `weight` float8_e4m3fn [N, K] and
`weight_scale_inv` float32 [ceil(N / b0), ceil(K / b1)]; the real weight is weight * its block's scale (the
"_inv" multiplies: transformers' `_dequantize_fp8_weight`, vLLM's block GEMM). Activations are quantized at
run time per token and group of b1 columns: kiln's `fp8_block` scheme. Without `weight_block_size` the scale
is per tensor, `weight_scale` (AutoFP8's and vLLM's per-tensor layout, with `input_scale` when the
activation scheme is static): kiln's `fp8_dynamic` / `fp8`, each part's scale expanded to its rows.

Which modules are quantized is what the checkpoint's tensors say; `modules_to_not_convert` is matched as
transformers does (a module path prefix up to a dot, or a suffix) and must agree with the tensors.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kiln.checkpoints.prequant.base import CheckpointQuantization, ReadTensor
from kiln.model_defs.layers.linear import Linear
from kiln.model_defs.recipes import FUSED_MODULES
from kiln.quant.base import QuantError
from kiln.quant.selection import DEFAULT_EXCLUDED
from kiln.quant.spec import QuantSpec

FORMAT = "quant_method fp8"
# Scale dtypes that become float32 exactly.
_EXACT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def from_checkpoint(checkpoint: Path, quantization_config: dict[str, Any], hf_quant_config: dict[str, Any] | None,
                    names: set[str]) -> CheckpointQuantization:
    """The reader for this checkpoint's FP8 layout; QuantError naming config.json's field and value (and what
    kiln reads) for a setting it cannot read exactly. `hf_quant_config` (ModelOpt's file) plays no part."""
    where = f"{checkpoint / 'config.json'}: quantization_config"
    config = quantization_config
    fmt = str(config.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise QuantError(f"{where}.fmt={config.get('fmt')!r} is not read by kiln; it reads FP8 checkpoints of fmt "
                         f"\"e4m3\" (float8_e4m3fn weights)")
    scheme = str(config.get("activation_scheme", "dynamic")).lower()
    block = config.get("weight_block_size")
    if scheme not in ("dynamic", "static") or (block is not None and scheme != "dynamic"):
        raise QuantError(f"{where}.activation_scheme={config.get('activation_scheme')!r} is not read by kiln; it "
                         f"reads \"dynamic\" with weight_block_size (block-scaled FP8), and \"dynamic\" or \"static\" "
                         f"without it (per-tensor FP8)")
    for key, fine in (("modules_to_convert", lambda v: not v), ("expert_dtype", lambda v: v in (None, "fp8")),
                      ("scale_fmt", lambda v: v in (None, "float", "ue8m0"))):
        if not fine(config.get(key)):
            raise QuantError(f"{where}.{key}={config.get(key)!r} is not read by kiln; it reads FP8 linear layers "
                             f"(no FP8 embeddings, FP8 experts only, float32 scales)")
    # transformers reads ignored_layers when modules_to_not_convert is absent.
    key = "modules_to_not_convert" if config.get("modules_to_not_convert") is not None else "ignored_layers"
    excluded = config.get(key)
    if excluded is None:
        excluded = []
    if not isinstance(excluded, list) or not all(isinstance(e, str) for e in excluded):
        raise QuantError(f"{where}.{key}={excluded!r:.80} must be a list of module names")
    if block is None:
        blocked = sorted(_quantized_modules(names, "weight_scale_inv"))
        if blocked:
            raise QuantError(f"{where} has no weight_block_size, but the checkpoint stores weight_scale_inv (block "
                             f"scales, e.g. {blocked[0]}.weight_scale_inv); kiln reads block-scaled FP8 with "
                             f"weight_block_size [rows, columns], and per-tensor FP8 (weight_scale) without it")
        scale = "weight_scale"
        quantized = _quantized_modules(names, scale)
        exclude = _exclusions(excluded, names, quantized, scale, f"{where}.{key}")
        return Fp8TensorCheckpoint(exclude, dynamic=scheme == "dynamic", names=names)
    if (not isinstance(block, list | tuple) or len(block) != 2
            or any(type(b) is not int or b <= 0 for b in block)):
        raise QuantError(f"{where}.weight_block_size={block!r} must be two positive integers [rows, columns]")
    quantized = _quantized_modules(names, "weight_scale_inv")
    exclude = _exclusions(excluded, names, quantized, "weight_scale_inv", f"{where}.{key}")
    return Fp8BlockCheckpoint(exclude, (block[0], block[1]), names)


class Fp8BlockCheckpoint(CheckpointQuantization):
    """Block-scaled FP8: kiln's `fp8_block` with the checkpoint's block size."""

    def __init__(self, exclude: tuple[str, ...], block_size: tuple[int, int], names: set[str]) -> None:
        self.exclude = exclude
        self.block_size = block_size
        self.names = names
        self.name = f"FP8 block ({FORMAT}, weight_block_size [{block_size[0]}, {block_size[1]}])"

    def quant_spec(self) -> QuantSpec:
        return QuantSpec(qformat="fp8_block", kv_cache_dtype="auto", block_size=self.block_size,
                         exclude_modules=self.exclude, source=self.name)

    def module_tensors(self, module: str) -> tuple[str, ...]:
        return f"{module}.weight", f"{module}.weight_scale_inv"

    def layer_tensors(self, prefix: str, layer: Linear, modules: Sequence[str],
                      read: ReadTensor) -> dict[str, torch.Tensor]:
        b0, b1 = self.block_size
        weights, scales = [], []
        for i, module in enumerate(modules):
            weight = _fp8_weight(prefix, layer, modules, i, read, self.names, "weight_scale_inv")  # [rows, K]
            rows, k = weight.shape
            # A block row's scale covers b0 consecutive rows: a part ending inside a block would share it with
            # the next part's first rows, which have scales of their own.
            if i < len(modules) - 1 and rows % b0:
                raise QuantError(f"{prefix}: part {module} has {rows} rows, not a multiple of the checkpoint's "
                                 f"block of {b0} rows, so its blocks cannot be fused by rows with "
                                 f"{', '.join(modules[i + 1:])}; kiln cannot build this layer exactly")
            scale = _scale(f"{module}.weight_scale_inv", read, (math.ceil(rows / b0), math.ceil(k / b1)),
                           f"ceil([{rows}, {k}] / block [{b0}, {b1}])")
            weights.append(weight)
            scales.append(scale)
        return {"weight": torch.cat(weights).contiguous(), "weight_scale_inv": torch.cat(scales).contiguous()}

    def reorder_rows(self, prefix: str, tensors: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
        # Exact when every row stays in its block of b0 rows (the blocks' scales then stay as they are).
        b0 = self.block_size[0]
        rows = torch.arange(order.numel())
        moved = (order // b0 != rows // b0).nonzero()
        if moved.numel():
            i = int(moved[0])
            raise QuantError(f"{prefix}: the model reorders this layer's rows at build (DeepSeek's rope rows, "
                             f"interleaved to halves), which would move row {int(order[i])} into row {i}, another "
                             f"block of the checkpoint's weight_block_size rows ({b0}); kiln cannot build it exactly")
        return {**tensors, "weight": tensors["weight"][order].contiguous()}


class Fp8TensorCheckpoint(CheckpointQuantization):
    """Per-tensor FP8 (no weight_block_size): kiln's `fp8_dynamic`, or `fp8` with the static `input_scale`.
    A per-channel `weight_scale` ([N] or [N, 1]) is read as well: kiln keeps a scale per row either way."""

    def __init__(self, exclude: tuple[str, ...], dynamic: bool, names: set[str]) -> None:
        self.exclude = exclude
        self.dynamic = dynamic
        self.names = names
        self.name = f"FP8 per tensor ({FORMAT}, activation_scheme {'dynamic' if dynamic else 'static'})"

    def quant_spec(self) -> QuantSpec:
        return QuantSpec(qformat="fp8_dynamic" if self.dynamic else "fp8", kv_cache_dtype="auto",
                         exclude_modules=self.exclude, source=self.name)

    def module_tensors(self, module: str) -> tuple[str, ...]:
        return (f"{module}.weight", f"{module}.weight_scale") + ((f"{module}.input_scale",) * (not self.dynamic))

    def layer_tensors(self, prefix: str, layer: Linear, modules: Sequence[str],
                      read: ReadTensor) -> dict[str, torch.Tensor]:
        weights, row_scales, input_scales = [], [], []
        for i, module in enumerate(modules):
            weight = _fp8_weight(prefix, layer, modules, i, read, self.names, "weight_scale")  # [rows, K]
            rows = weight.shape[0]
            name = f"{module}.weight_scale"
            scale = _scale(name, read, None, "")
            if scale.numel() not in (1, rows):
                raise QuantError(f"{name} has shape {list(scale.shape)}; kiln reads a per-tensor scale (one value) "
                                 f"or one per row ({rows})")
            weights.append(weight)
            row_scales.append(scale.reshape(-1).expand(rows))
            if not self.dynamic:
                input_scales.append((f"{module}.input_scale", _input_scale(prefix, module, read, self.names)))
        tensors = {"weight": torch.cat(weights).contiguous(), "weight_scale": torch.cat(row_scales).contiguous()}
        if not self.dynamic:
            # kiln quantizes a fused layer's input once, with one scale: exact only when the parts agree (they
            # saw the same input, so a calibration gives them the same amax).
            values = {n: s.item() for n, s in input_scales}
            if len(set(values.values())) > 1:
                raise QuantError(f"{prefix}: its parts have different static input scales ({values}); kiln "
                                 f"quantizes a fused layer's input with one scale and cannot build it exactly")
            tensors["input_scale"] = input_scales[0][1].reshape(1)
        return tensors


def _quantized_modules(names: set[str], scale: str) -> set[str]:
    suffix = f".{scale}"
    return {n.removesuffix(suffix) for n in names if n.endswith(suffix)}


def _patterns(entry: str) -> tuple[str, ...]:
    """fnmatch patterns for a modules_to_not_convert entry, as transformers' should_convert_module matches it:
    the path from its start up to a module boundary, or any suffix."""
    return entry, f"{entry}.*", f"*{entry}"


def _excluded(module: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def _fused_name(module: str) -> tuple[str, tuple[str, ...]] | None:
    """'…self_attn.k_proj' -> ('…self_attn.qkv_proj', (…q_proj, …k_proj, …v_proj)): kiln's fused layer that
    a checkpoint module goes into, with all its parts; None for a module kiln does not fuse."""
    parent, _, last = module.rpartition(".")
    for fused, parts in FUSED_MODULES.items():
        if last in parts:
            join = (lambda m: f"{parent}.{m}") if parent else (lambda m: m)
            return join(fused), tuple(join(p) for p in parts)
    return None


def _exclusions(entries: list[str], names: set[str], quantized: set[str], scale: str, field: str) -> tuple[str, ...]:
    """engine exclude_modules (fnmatch patterns on kiln's module paths): the entries' patterns, a fused layer
    whose parts are all excluded, and lm_head unless the checkpoint quantized it. QuantError when an entry
    names a module the checkpoint stores quantized."""
    patterns = [p for e in entries for p in _patterns(e)]
    modules = {n.removesuffix(".weight") for n in names if n.endswith(".weight")}
    # Entries name checkpoint modules; kiln's q/k/v and gate/up are one layer, excluded when all its parts are.
    fused = [found[0] for found in map(_fused_name, sorted(modules))
             if found is not None and all(_excluded(part, patterns) for part in found[1])]
    for module in sorted(quantized):
        found = _fused_name(module)
        engine = module if found is None else found[0]
        if _excluded(module, patterns) or _excluded(engine, patterns):
            raise QuantError(f"{field} leaves {engine if _excluded(engine, patterns) else module} unquantized, but "
                             f"the checkpoint stores {module} quantized ({module}.{scale}); kiln cannot build it "
                             f"exactly")
    lm_head = () if "lm_head" in quantized else DEFAULT_EXCLUDED
    return tuple(dict.fromkeys([*lm_head, *patterns, *fused]))


def _fp8_weight(prefix: str, layer: Linear, modules: Sequence[str], i: int, read: ReadTensor, names: set[str],
                scale: str) -> torch.Tensor:
    """Part i's FP8 weight [rows, K], after checking that the checkpoint holds it quantized and that its shape is
    the one the engine layer (config.json) gives that part."""
    module = modules[i]
    if f"{module}.{scale}" not in names:
        fused = len(modules) > 1
        raise QuantError(f"{prefix} is quantized in the engine (quantization_config's modules_to_not_convert does not "
                         f"exclude it), but the checkpoint stores {module} unquantized (no {module}.{scale})"
                         + ("; a fused layer's parts must all be quantized, or all be excluded" if fused else ""))
    weight = read(f"{module}.weight")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise QuantError(f"{module}.weight is {weight.dtype} {list(weight.shape)}; an FP8 checkpoint stores "
                         f"float8_e4m3fn [out, in]")
    rows = layer.output_sizes[i] if len(layer.output_sizes) == len(modules) else weight.shape[0]
    if tuple(weight.shape) != (rows, layer.in_features):
        raise QuantError(f"{module}.weight has shape {list(weight.shape)}, but config.json implies "
                         f"[{rows}, {layer.in_features}] for this part of {prefix}; does config.json belong to these "
                         f"weights?")
    return weight


def _scale(name: str, read: ReadTensor, shape: tuple[int, ...] | None, what: str) -> torch.Tensor:
    """A float scale tensor as float32 (exactly: float16 and bfloat16 widen without rounding)."""
    scale = read(name)
    if scale.dtype not in _EXACT_SCALE_DTYPES:
        raise QuantError(f"{name} is {scale.dtype}; kiln reads float32, bfloat16 or float16 scales")
    if shape is not None and tuple(scale.shape) != shape:
        raise QuantError(f"{name} has shape {list(scale.shape)}, expected {list(shape)} ({what})")
    return scale.float()


def _input_scale(prefix: str, module: str, read: ReadTensor, names: set[str]) -> torch.Tensor:
    name = f"{module}.input_scale"
    if name not in names:
        raise QuantError(f"{prefix}: activation_scheme static, but the checkpoint has no {name}")
    scale = _scale(name, read, None, "")
    if scale.numel() != 1:
        raise QuantError(f"{name} has shape {list(scale.shape)}; kiln reads one static input scale per tensor")
    return scale
