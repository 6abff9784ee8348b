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
The config's side (the scheme, which modules) is compressed_tensors_config.py; this file reads the tensors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from kiln.checkpoints.prequant.base import CheckpointQuantization, ReadTensor
from kiln.checkpoints.prequant.compressed_tensors_config import (
    Scheme,
    linear_layers,
    parse_kv_cache,
    parse_scheme,
    read_config,
    select_modules,
)
from kiln.checkpoints.prequant.detect import QUANTIZED_TENSOR_NAMES
from kiln.model_defs.layers.linear import Linear
from kiln.plugins.int4_pack import pack_int4
from kiln.quant.base import QuantError
from kiln.quant.spec import QuantSpec

# compressed-tensors' tensors of schemes kiln refuses (act-order, activation zero points, attention scales),
# besides detect.py's QUANTIZED_TENSOR_NAMES: never read as anything else.
OTHER_QUANTIZED = ("weight_g_idx", "input_zero_point", "q_scale", "output_scale")
# The module tensors each layout may hold (besides the layer's float bias).
LAYOUT_TENSORS = ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "input_scale")


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
    scheme, targets = parse_scheme(where, config)
    raw = read_config(checkpoint)
    layers = linear_layers(checkpoint, raw)
    ignore = config.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise QuantError(f"{where}.ignore={ignore!r} must be a list of module names or 're:' patterns")
    quantized, excluded = select_modules(where, layers, targets, ignore, names)
    kv = parse_kv_cache(where, config.get("kv_cache_scheme"))
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


def _kv_names(layer: int) -> tuple[str, str]:
    return f"model.layers.{layer}.self_attn.k_scale", f"model.layers.{layer}.self_attn.v_scale"


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
