"""compressed-tensors checkpoints (llm-compressor's `oneshot`; config.json `quantization_config.quant_method`
"compressed-tensors") read exactly into kiln's engine tensors.

The layout, after compressed-tensors' compressors (checked against 0.19 and 0.20):
- `float-quantized` / `int-quantized` / `naive-quantized`: `<module>.weight` holds the codes in their torch
  dtype (float8_e4m3fn, or int8 for any int width), `weight_scale` the scales: [1] per tensor, [N, 1] per
  channel, [N, K / group] per group, [ceil(N / b0), ceil(K / b1)] per block; `input_scale` [1] for a static
  per-tensor activation scale; `weight_zero_point` (same shape, signed) when asymmetric.
- `pack-quantized` (int weights of 1-8 bits): `weight_packed` int32 [N, ceil(K * bits / 32)], each code
  stored as q + 2^(bits-1) (unsigned) at bit offset (i * bits) of its 32-element run, little end first, so
  4-bit codes are 8 to a word and 8-bit ones 4; `weight_shape` [2] = (N, K). Asymmetric zero points are
  packed the same way along dim 0: int32 [ceil(N * bits / 32), groups].
- Real value = (q - zero_point) * scale, q and the zero point signed (-2^(bits-1) .. 2^(bits-1) - 1).
- KV cache (`kv_cache_scheme`): per-layer `self_attn.k_scale` / `self_attn.v_scale` [1] (value = q * scale).
- `ignore` and each group's `targets` name modules exactly, by a "re:" pattern (re.match, anchored at the
  start only) or by class ("Linear").

kiln reads the schemes its engines have (one for every quantized layer); fused layers keep each part's own
scales, concatenated by rows, except a W8A8 layer's static input scale, of which it has one (see
`_shared_input_scale`). Which layers stay unquantized is decided per checkpoint module from `targets` and
`ignore`, checked against the tensors the checkpoint holds, and recorded as the engine's exclude_modules.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.model_defs import build_network, model_def_for_hf_config
from kiln.model_defs.layers.linear import Linear
from kiln.model_defs.recipes import Concat, Single
from kiln.plugins.int4_pack import pack_int4

from ..base import QuantError
from ..spec import QuantSpec
from .base import CheckpointQuantization, ReadTensor
from .detect import QUANTIZED_TENSOR_NAMES

PLAIN_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")  # codes in their torch dtype
PACKED_FORMAT = "pack-quantized"
SUPPORTED = ("FP8 W8A8 with per-tensor or per-channel weight scales and a static per-tensor (-> fp8) or dynamic "
             "per-token (-> fp8_dynamic) input scale; FP8 block-scaled weights with dynamic per-token-group "
             "inputs (-> fp8_block); INT8 W8A8 with per-tensor or per-channel weight scales and a dynamic "
             "per-token (-> int8_dynamic) or static per-tensor (-> int8_sq) input scale; INT4 / INT8 "
             "weight-only, per group or per channel, symmetric or asymmetric (-> weight_only); all symmetric "
             "activations, one scheme for every quantized layer, formats float-quantized, int-quantized, "
             "naive-quantized and pack-quantized, an optional FP8 per-tensor kv_cache_scheme")
# compressed-tensors' tensors of schemes kiln refuses (act-order, activation zero points, attention scales),
# besides detect.py's QUANTIZED_TENSOR_NAMES: never read as anything else.
OTHER_QUANTIZED = ("weight_g_idx", "input_zero_point", "q_scale", "output_scale")
# The module tensors each layout may hold (besides the layer's float bias).
LAYOUT_TENSORS = ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "input_scale")


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


def from_checkpoint(checkpoint: Path, quantization_config: dict, hf_quant_config: dict | None,
                    names: set[str]) -> CompressedTensorsQuantization:
    """The reader of a compressed-tensors checkpoint; QuantError (naming the config field or tensor and its
    value, and what kiln reads) for one kiln cannot build exactly."""
    where = f"{checkpoint / 'config.json'}: quantization_config"
    config = quantization_config
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantError(f"{where}.quantization_status={status!r}: kiln reads compressed checkpoints only "
                         f"(quantization_status 'compressed', as llm-compressor saves them)")
    for field in ("sparsity_config", "transform_config"):
        if config.get(field):
            raise QuantError(f"{where}.{field} is set ({json.dumps(config[field])[:120]}): kiln reads neither sparse "
                             f"nor transformed (Hadamard / SpinQuant) compressed-tensors checkpoints")
    scheme, targets = _scheme(where, config)
    raw = _read_config(checkpoint)
    layers = _linear_layers(checkpoint, raw)
    ignore = config.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise QuantError(f"{where}.ignore={ignore!r} must be a list of module names or 're:' patterns")
    quantized, excluded = _select(where, layers, targets, ignore, names)
    kv = _kv_cache(where, config.get("kv_cache_scheme"))
    num_layers = int(raw.get("num_hidden_layers", 0))
    reader = CompressedTensorsQuantization(checkpoint, scheme, quantized, excluded, kv, num_layers,
                                           config.get("version"))
    reader.check_tensors(names)
    return reader


class CompressedTensorsQuantization(CheckpointQuantization):
    def __init__(self, checkpoint: Path, scheme: Scheme, quantized: set[str], excluded: tuple[str, ...],
                 kv_cache: str | None, num_layers: int, version: str | None) -> None:
        self.checkpoint = checkpoint
        self.scheme = scheme
        self.quantized = quantized  # checkpoint modules stored quantized
        self.excluded = excluded  # engine layers left unquantized (fnmatch patterns)
        self.kv_cache = kv_cache
        self.num_layers = num_layers
        acts = "unquantized" if scheme.inputs is None else scheme.inputs.describe()
        self.name = (f"compressed-tensors{' ' + version if version else ''} {scheme.storage}: "
                     f"{scheme.weights.describe()} weights, {acts} activations")

    def quant_spec(self) -> QuantSpec:
        s, w = self.scheme, self.scheme.weights
        weight_only = s.qformat == "weight_only"
        return QuantSpec(qformat=s.qformat, kv_cache_dtype="auto", exclude_modules=self.excluded,
                         group_size=w.group_size if weight_only and w.strategy == "group" else None,
                         bits=w.num_bits if weight_only else None, zero_point=weight_only and s.zero_point,
                         block_size=s.block_size, source=self.name)

    def module_tensors(self, module: str) -> tuple[str, ...]:
        return tuple(f"{module}.{t}" for t in LAYOUT_TENSORS)

    def layer_tensors(self, prefix: str, layer: Linear, modules: Sequence[str],
                      read: ReadTensor) -> dict[str, torch.Tensor]:
        qformat = self.scheme.qformat
        if qformat == "weight_only":
            return self._weight_only(prefix, modules, read)
        if qformat == "fp8_block":
            return self._fp8_block(prefix, modules, read)
        return self._w8a8(prefix, modules, read)

    def kv_cache_scales(self, read: ReadTensor, names: set[str],
                        num_layers: int) -> tuple[str, list[tuple[float, float]]] | None:
        if self.kv_cache is None:
            return None
        scales = []
        for i in range(num_layers):
            k, v = (_scalar(name, read(name)) for name in _kv_names(i))
            scales.append((k, v))
        return self.kv_cache, scales

    def kv_scale_tensors(self, num_layers: int) -> tuple[str, ...]:
        return () if self.kv_cache is None else tuple(n for i in range(num_layers) for n in _kv_names(i))

    def check_tensors(self, names: set[str]) -> None:
        """Every quantized module has its layout's tensors, and no other module holds quantized ones (they
        would be read as float weights or not at all): checked from the names, before any build work."""
        s = self.scheme
        needed = (["weight_packed", "weight_shape"] if s.packed else ["weight"]) + ["weight_scale"]
        needed += ["weight_zero_point"] * s.zero_point + ["input_scale"] * s.static_input
        for module in sorted(self.quantized):
            missing = [f"{module}.{t}" for t in needed if f"{module}.{t}" not in names]
            if missing:
                raise QuantError(f"checkpoint {self.checkpoint} lacks {', '.join(missing)}, which its "
                                 f"quantization_config ({self.name}) says it stores")
        kv = set(self.kv_scale_tensors(self.num_layers))
        missing_kv = sorted(kv - names)
        if missing_kv:
            raise QuantError(f"checkpoint {self.checkpoint} lacks {', '.join(missing_kv[:3])}: its "
                             f"quantization_config.kv_cache_scheme says it stores per-layer KV-cache scales")
        allowed = set(needed)
        for name in sorted(names):
            module, _, tensor = name.rpartition(".")
            if tensor not in (*QUANTIZED_TENSOR_NAMES, *OTHER_QUANTIZED) or name in kv:
                continue
            if module not in self.quantized or tensor not in allowed:
                raise QuantError(
                    f"checkpoint {self.checkpoint} holds {name}, which kiln would not read: "
                    + ("the module is not a quantized linear layer under quantization_config's targets and ignore"
                       if module not in self.quantized else f"the scheme ({self.name}) stores no {tensor}"))

    # --- engine tensors per scheme ---------------------------------------------------------------------

    def _w8a8(self, prefix: str, modules: Sequence[str], read: ReadTensor) -> dict[str, torch.Tensor]:
        """fp8 / fp8_dynamic / int8_sq / int8_dynamic: weight [N, K] fp8 or int8, weight_scale [N] float32
        (each part's per-tensor or per-channel scale on its rows), input_scale [1] when static (plus
        int8_sq's pre_quant_scale [K] of ones: compressed-tensors does no smoothing)."""
        fp8 = self.scheme.weights.type == "float"
        weights, scales = [], []
        for m in modules:
            w = self._float_codes(m, read) if fp8 else self._int_codes(m, read)  # [N_i, K]
            weights.append(w)
            scales.append(self._row_scales(m, read, w.shape[0]))  # [N_i]
        out = {"weight": _cat_rows(prefix, weights), "weight_scale": torch.cat(scales).contiguous()}
        if self.scheme.static_input:
            out["input_scale"] = _shared_input_scale(modules, read)
        if self.scheme.qformat == "int8_sq":
            out["pre_quant_scale"] = torch.ones(out["weight"].shape[1])
        return out

    def _weight_only(self, prefix: str, modules: Sequence[str], read: ReadTensor) -> dict[str, torch.Tensor]:
        """weight_only: qweight 4-bit uint8 [N, K / 2] (pack_int4 of u = q + 8) or 8-bit [N, K] (int8 q when
        symmetric, uint8 q + 128 when asymmetric), scales [N, groups] float32, zeros [N, groups] uint8
        (zero point + 8 or + 128, so that u - zeros = q - zero_point) when asymmetric."""
        bits, offset = self.scheme.weights.num_bits, 1 << (self.scheme.weights.num_bits - 1)
        codes, scales, zeros = [], [], []
        for m in modules:
            q = self._int_codes(m, read)  # [N_i, K] int8
            s = _float32(f"{m}.weight_scale", read(f"{m}.weight_scale"))
            groups = 1 if self.scheme.weights.strategy == "channel" else q.shape[1] // self.scheme.weights.group_size
            _check_shape(f"{m}.weight_scale", s, (q.shape[0], groups))
            codes.append(q)
            scales.append(s)
            if self.scheme.zero_point:
                zeros.append(self._zero_points(m, read, q.shape[0], groups))
        q = _cat_rows(prefix, codes).to(torch.int16)  # [N, K]: int16 so that q + 128 does not wrap
        if bits == 4:
            qweight = pack_int4((q + offset).to(torch.uint8))
        else:
            qweight = (q + offset).to(torch.uint8) if self.scheme.zero_point else q.to(torch.int8)
        out = {"qweight": qweight.contiguous(), "scales": torch.cat(scales).contiguous()}
        if self.scheme.zero_point:
            out["zeros"] = (torch.cat(zeros).to(torch.int16) + offset).to(torch.uint8).contiguous()
        return out

    def _fp8_block(self, prefix: str, modules: Sequence[str], read: ReadTensor) -> dict[str, torch.Tensor]:
        """fp8_block (Fp8BlockLinear): weight [N, K] fp8, weight_scale_inv [ceil(N / b0), ceil(K / b1)] float32
        (a multiplier despite the name, as DeepSeek's). A fused layer's scale rows line up with its weight rows
        only if every part but the last fills whole blocks of rows; otherwise it is refused."""
        b0, b1 = self.scheme.block_size
        weights, scales = [], []
        for i, m in enumerate(modules):
            w = self._float_codes(m, read)  # [N_i, K]
            n, k = w.shape
            if n % b0 and i < len(modules) - 1:
                raise QuantError(f"{prefix}: its part {m} has {n} rows, not a multiple of the {b0}-row weight "
                                 f"block, so the fused layer's block scales would straddle parts; kiln cannot "
                                 f"build this block-scaled FP8 checkpoint exactly")
            s = _float32(f"{m}.weight_scale", read(f"{m}.weight_scale"))
            _check_shape(f"{m}.weight_scale", s, (math.ceil(n / b0), math.ceil(k / b1)))
            weights.append(w)
            scales.append(s)
        return {"weight": _cat_rows(prefix, weights), "weight_scale_inv": torch.cat(scales).contiguous()}

    # --- one part's tensors ----------------------------------------------------------------------------

    def _float_codes(self, module: str, read: ReadTensor) -> torch.Tensor:
        w = read(f"{module}.weight")
        if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
            raise QuantError(f"{module}.weight is {w.dtype} {list(w.shape)}; the scheme ({self.name}) stores "
                             f"float8_e4m3fn [out, in]")
        return w

    def _int_codes(self, module: str, read: ReadTensor) -> torch.Tensor:
        """The module's signed integer codes, int8 [N, K], from `weight` or unpacked from `weight_packed`."""
        bits = self.scheme.weights.num_bits
        if self.scheme.packed:
            shape = read(f"{module}.weight_shape").tolist()
            packed = read(f"{module}.weight_packed")
            if len(shape) != 2:
                raise QuantError(f"{module}.weight_shape={shape} must be [out, in]")
            _check_shape(f"{module}.weight_packed", packed, (shape[0], math.ceil(shape[1] * bits / 32)), torch.int32)
            q = unpack_int32(packed, bits, shape[1])
        else:
            q = read(f"{module}.weight")
            if q.dtype != torch.int8 or q.dim() != 2:
                raise QuantError(f"{module}.weight is {q.dtype} {list(q.shape)}; the scheme ({self.name}) stores "
                                 f"int8 [out, in]")
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
            raise QuantError(f"{module}: codes range {int(q.min())}..{int(q.max())}, outside {bits}-bit {lo}..{hi}")
        return q

    def _row_scales(self, module: str, read: ReadTensor, rows: int) -> torch.Tensor:
        """W8A8: the part's weight scale as one float32 per row [rows] (a per-tensor scale repeated)."""
        s = _float32(f"{module}.weight_scale", read(f"{module}.weight_scale"))
        if self.scheme.weights.strategy == "tensor":
            _check_shape(f"{module}.weight_scale", s.reshape(-1), (1,))
            return s.reshape(1).expand(rows)
        if tuple(s.shape) not in ((rows, 1), (rows,)):  # [rows, 1] as saved; [rows] tolerated
            _check_shape(f"{module}.weight_scale", s, (rows, 1))
        return s.reshape(rows)

    def _zero_points(self, module: str, read: ReadTensor, rows: int, groups: int) -> torch.Tensor:
        """The part's signed zero points [rows, groups] int8: packed along dim 0 (int32 [ceil(rows * bits /
        32), groups]) in pack-quantized checkpoints, as they are in the other formats."""
        name, bits = f"{module}.weight_zero_point", self.scheme.weights.num_bits
        zp = read(name)
        if self.scheme.packed and zp.dtype == torch.int32 and tuple(zp.shape) == (math.ceil(rows * bits / 32), groups):
            zp = unpack_int32(zp.t().contiguous(), bits, rows).t()
        _check_shape(name, zp, (rows, groups))
        if zp.dtype.is_floating_point or zp.dtype == torch.bool:
            raise QuantError(f"{name} is {zp.dtype}; kiln reads integer zero points")
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if zp.numel() and (int(zp.min()) < lo or int(zp.max()) > hi):
            raise QuantError(f"{name}: zero points {int(zp.min())}..{int(zp.max())}, outside {bits}-bit {lo}..{hi}")
        return zp.to(torch.int8)


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 undone for a width that divides 32 (4 or 8 bits):
    packed [R, ceil(cols * bits / 32)] int32 -> [R, cols] int8 signed codes. Code i of a row sits in word
    i // (32 / bits) at bit (i % (32 / bits)) * bits, stored as q + 2^(bits - 1)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits  # [per_word]
    # An arithmetic shift of a negative word fills with ones above bit 31; the mask keeps the code's bits only.
    u = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, W, per_word]
    u = u.reshape(packed.shape[0], -1)[:, :cols]
    return (u - (1 << (bits - 1))).to(torch.int8)


def _shared_input_scale(modules: Sequence[str], read: ReadTensor) -> torch.Tensor:
    """A fused layer's one static input scale [1] float32: the largest of its parts' (q, k and v read the same
    input, yet calibration gives each its own scale). As vLLM does: the largest never clips what any part's
    own scale would have kept, at the cost of a coarser step for the parts calibrated finer. Exact for a
    single module, and for parts whose scales agree (llm-compressor observes the same input for each)."""
    scales = [_float32(f"{m}.input_scale", read(f"{m}.input_scale")).reshape(-1) for m in modules]
    for m, s in zip(modules, scales):
        _check_shape(f"{m}.input_scale", s, (1,))
    return torch.stack(scales).amax(dim=0).contiguous()  # [1]


# --- config.json: the scheme ---------------------------------------------------------------------------

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


def _scheme(where: str, config: dict) -> tuple[Scheme, list[str]]:
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


def _kv_cache(where: str, value: Any) -> str | None:
    if value is None:
        return None
    kv = _parse_args(f"{where}.kv_cache_scheme", value)
    if (kv.type, kv.num_bits, kv.strategy, kv.symmetric, kv.dynamic) != ("float", 8, "tensor", True, False):
        raise QuantError(f"{where}.kv_cache_scheme ({kv.describe()}) is not one kiln reads: kiln reads a static, "
                         f"symmetric FP8 scale per layer for K and for V (strategy 'tensor')")
    return "fp8"


def _kv_names(layer: int) -> tuple[str, str]:
    return f"model.layers.{layer}.self_attn.k_scale", f"model.layers.{layer}.self_attn.v_scale"


# --- which layers are quantized ------------------------------------------------------------------------

def _read_config(checkpoint: Path) -> dict[str, Any]:
    try:
        return json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise QuantError(f"cannot read {checkpoint / 'config.json'}: {e}") from None


def _linear_layers(checkpoint: Path, raw: dict[str, Any]) -> dict[str, tuple[str, ...]]:
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


def _select(where: str, layers: dict[str, tuple[str, ...]], targets: list[str], ignore: list[str],
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


# --- small checks --------------------------------------------------------------------------------------

def _float32(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.dtype.is_floating_point or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise QuantError(f"{name} is {t.dtype}; kiln reads float16, bfloat16 or float32 scales")
    return t.float()  # exact from any of them


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    if tuple(t.shape) != tuple(shape) or (dtype is not None and t.dtype != dtype):
        want = f"{dtype} " if dtype is not None else ""
        raise QuantError(f"{name} is {t.dtype} {list(t.shape)}; the layout says {want}{list(shape)}")


def _cat_rows(prefix: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if len({p.shape[1] for p in parts}) != 1:
        raise QuantError(f"{prefix}: its parts have different input widths {[p.shape[1] for p in parts]}")
    return torch.cat(parts).contiguous()


def _scalar(name: str, t: torch.Tensor) -> float:
    if t.numel() != 1:
        raise QuantError(f"{name} has shape {list(t.shape)}; kiln reads one KV-cache scale per layer")
    return float(_float32(name, t).reshape(()))
