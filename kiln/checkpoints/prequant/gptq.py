"""GPTQ checkpoints (config.json `quantization_config.quant_method: "gptq"`: AutoGPTQ, GPTQModel, optimum), read
exactly into kiln's weight-only engine tensors.

The layout, as AutoGPTQ's QuantLinear packs it (auto_gptq/nn_modules/qlinear/qlinear_cuda.py `pack`, unpacked
by its torch fallback in `forward`; GPTQModel's packers and vLLM's gptq kernels agree), for a linear layer of
`in` inputs and `out` outputs, b = bits (4 or 8), p = 32 / b values per int32, groups of G input columns
(group_size -1: G = in):
- qweight: int32 [in / p, out], packed along the input: bits b*j .. b*j + b-1 of word [r, o] hold input row
  r*p + j of output column o (no interleave), unsigned 0 .. 2^b - 1.
- qzeros: int32 [in / G, out / p], packed along the output the same way: word [g, c] field j is the zero point
  of group g, output column c*p + j.
- scales: float16 [in / G, out].
- g_idx: int32 [in], the group of each input column: k // G, or a permutation of it when desc_act quantized the
  columns in order of activation size (act-order; the columns themselves stay in their original order).
- weight[o, k] = (q[k, o] - z[g_idx[k], o]) * s[g_idx[k], o].
- Zero points: format "gptq" (v1) stores z - 1, packed as int32 arithmetic (GPTQModel writes v1 by subtracting
  0x11111111 / 0x01010101 from the v2 words, and reads it back by adding them: gptqmodel/utils/model.py
  convert_gptq_v1_to_v2_format_module); "gptq_v2" stores z. Field by field the +1 is what AutoGPTQ's and
  vLLM's kernels add; the two readings differ only where a stored field is all ones (a v1 zero point of 0,
  which AutoGPTQ's packer stored as a sign-extended -1 that also overwrote the fields above it), and kiln takes GPTQModel's, which inverts its writer exactly.

Into kiln (quant/weight_only.py): values [out, in], scales [out, in / G] float32 (the transpose; fp16 widens
exactly), g_idx [in] int32 when some layer's groups are not k // G. Symmetric checkpoints (sym: true) have zero
point 2^(b-1) everywhere, which is kiln's symmetric offset: 4-bit values are stored as they are (u = q + 8,
packed by pack_int4), 8-bit ones as int8 u - 128; the zero points are checked and dropped. Asymmetric ones keep
u (4-bit packed, 8-bit uint8 [out, in]) and zeros [out, in / G] uint8. A fused kiln layer ([q; k; v],
[gate; up]) concatenates its parts' rows, each with its own scales and zeros; its parts must share one g_idx
(they do: they see the same inputs, so GPTQ orders their columns alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kiln.checkpoints.prequant.base import CheckpointQuantization, ReadTensor
from kiln.checkpoints.reader import CheckpointError, CheckpointReader
from kiln.model_defs.layers.linear import Linear
from kiln.plugins.int4_pack import pack_int4
from kiln.quant.base import QuantError
from kiln.quant.selection import DEFAULT_EXCLUDED
from kiln.quant.spec import QuantSpec

BITS = (4, 8)
FORMATS = ("gptq", "gptq_v2")
# v1 -> v2 zero points: +1 in every field of the int32 word, as one integer addition (GPTQModel's reading).
V1_ZERO_OFFSET = {4: 0x11111111, 8: 0x01010101}
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
G_IDX_DTYPES = (torch.int32, torch.int64)


def from_checkpoint(checkpoint: Path, quantization_config: dict[str, Any], hf_quant_config: dict[str, Any] | None,
                    names: set[str]) -> GptqCheckpoint:
    """The reader of a GPTQ checkpoint; QuantError (naming the config field, its value and what kiln reads) for a
    setting kiln cannot read exactly. Reads every g_idx (small) to learn whether any layer's groups are
    scattered (act-order), which decides the engine's scheme before any layer is made: the g_idx, not desc_act,
    says it (desc_act with static_groups keeps groups k // G)."""
    where = f"{checkpoint / 'config.json'}: quantization_config"
    if hf_quant_config is not None:
        raise QuantError(f"{where} says GPTQ but the checkpoint also has ModelOpt's hf_quant_config.json; kiln "
                         f"will not guess which of the two its tensors follow")
    config = quantization_config
    bits = config.get("bits")
    if bits not in BITS or isinstance(bits, bool):
        raise QuantError(f"{where}.bits={bits!r} is not a width kiln reads from GPTQ; kiln reads "
                         f"{' and '.join(map(str, BITS))}-bit GPTQ checkpoints")
    fmt = _format(config, where)
    if config.get("is_marlin_format"):
        raise QuantError(f"{where}.is_marlin_format=true: Marlin-repacked GPTQ is not a layout kiln reads; kiln "
                         f"reads the {' and '.join(FORMATS)} formats")
    pack_dtype = str(config.get("pack_dtype") or "int32").removeprefix("torch.")
    if pack_dtype != "int32":
        raise QuantError(f"{where}.pack_dtype={config.get('pack_dtype')!r}: kiln reads GPTQ packed in int32 words "
                         f"only")
    if config.get("dynamic"):
        raise QuantError(f"{where}.dynamic={config.get('dynamic')!r}: per-module overrides of the bits or group "
                         f"size are not something kiln reads; kiln reads one GPTQ setting for every layer")
    sym = config.get("sym", True)
    if not isinstance(sym, bool):
        raise QuantError(f"{where}.sym={sym!r} must be true or false")
    group_size = _group_size(config.get("group_size", 128), where)
    act_order = _any_scattered_groups(checkpoint, names, group_size)
    # A checkpoint that quantized lm_head (GPTQModel's lm_head: true) gets a quantized lm_head.
    exclude = () if "lm_head.qweight" in names else DEFAULT_EXCLUDED
    return GptqCheckpoint(bits, group_size, sym, act_order, fmt, exclude, frozenset(names))


def _format(config: dict[str, Any], where: str) -> str:
    """GPTQ's packing format: `checkpoint_format` (AutoGPTQ, transformers) or `format` (GPTQModel's newer name)."""
    given = {key: str(config[key]).lower() for key in ("checkpoint_format", "format") if config.get(key)}
    if len(set(given.values())) > 1:
        raise QuantError(f"{where} names two formats, checkpoint_format={config['checkpoint_format']!r} and "
                         f"format={config['format']!r}; kiln will not guess which one the tensors follow")
    fmt = next(iter(given.values()), "gptq")
    if fmt not in FORMATS:
        key = next(iter(given))
        raise QuantError(f"{where}.{key}={config[key]!r} is a GPTQ packing kiln does not read; kiln reads "
                         f"{' and '.join(repr(f) for f in FORMATS)} (not marlin, bitblas, ipex, qqq, ...)")
    return fmt


def _group_size(value: Any, where: str) -> int | None:
    """config group_size -> kiln's (None: one group per row)."""
    if value == -1:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 2 or value % 2:
        raise QuantError(f"{where}.group_size={value!r}: kiln reads GPTQ groups of an even number of input "
                         f"columns (e.g. 32, 64, 128) or -1 (per channel)")
    return value


def _any_scattered_groups(checkpoint: Path, names: set[str], group_size: int | None) -> bool:
    """Whether some module's g_idx is not k // G (act-order): then every layer gets a g_idx."""
    g_idx_names = sorted(n for n in names if n.endswith(".g_idx"))
    if not g_idx_names:
        return False
    try:
        with CheckpointReader(checkpoint) as reader:
            for name in g_idx_names:
                g_idx = _g_idx(name, reader.get(name), group_size)  # [K]
                if not torch.equal(g_idx, _plain_groups(g_idx.shape[0], group_size)):
                    return True
    except CheckpointError as e:
        raise QuantError(str(e)) from None
    return False


def _plain_groups(k: int, group_size: int | None) -> torch.Tensor:
    return torch.arange(k, dtype=torch.int32) // (group_size or k)  # [K]


def _g_idx(name: str, g_idx: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """A checkpoint g_idx, checked (1-D integers naming existing groups), as int32 [K]."""
    if g_idx.dim() != 1 or g_idx.dtype not in G_IDX_DTYPES:
        raise QuantError(f"checkpoint tensor {name} is {g_idx.dtype} {list(g_idx.shape)}; GPTQ's g_idx is int32 [in]")
    k = g_idx.shape[0]
    group = group_size or k
    if k % group:
        raise QuantError(f"checkpoint tensor {name}: {k} input columns do not divide into groups of {group}; kiln "
                         f"reads GPTQ whose group size divides every layer's input width")
    groups = k // group
    if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise QuantError(f"checkpoint tensor {name} names groups {int(g_idx.min())}..{int(g_idx.max())}; with "
                         f"{k} input columns in groups of {group} they must be in 0..{groups - 1}")
    return g_idx.to(torch.int32)


class GptqCheckpoint(CheckpointQuantization):
    """GPTQ in `bits` 4 or 8; `group_size` None is per channel; `act_order` when some layer's g_idx scatters its
    groups; `fmt` "gptq" (v1: zero points stored minus one) or "gptq_v2"."""

    def __init__(self, bits: int, group_size: int | None, sym: bool, act_order: bool, fmt: str,
                 exclude_modules: tuple[str, ...], names: frozenset[str]) -> None:
        self.bits = bits
        self.group_size = group_size
        self.sym = sym
        self.act_order = act_order
        self.fmt = fmt
        self.exclude_modules = exclude_modules
        self.names = names
        group = "per channel" if group_size is None else f"group {group_size}"
        self.name = (f"GPTQ {fmt} (INT{bits}, {group}, {'symmetric' if sym else 'zero point'}"
                     f"{', act-order' if act_order else ''})")

    def quant_spec(self) -> QuantSpec:
        return QuantSpec(qformat="weight_only", kv_cache_dtype="auto", group_size=self.group_size,
                         exclude_modules=self.exclude_modules, bits=self.bits, zero_point=not self.sym,
                         act_order=self.act_order, source=self.name)

    def module_tensors(self, module: str) -> tuple[str, ...]:
        return f"{module}.qweight", f"{module}.qzeros", f"{module}.scales", f"{module}.g_idx"

    def layer_tensors(self, prefix: str, layer: Linear, modules: Sequence[str],
                      read: ReadTensor) -> dict[str, torch.Tensor]:
        k = layer.in_features
        group = self.group_size or k
        if k % group:
            raise QuantError(f"{prefix}: in_features {k} is not divisible by the checkpoint's GPTQ group size "
                             f"{group}")
        parts = [self._part(prefix, module, k, group, read) for module in modules]
        u = torch.cat([p[0] for p in parts])  # [N, K] uint8 0 .. 2^bits - 1
        if u.shape[0] != layer.out_features:
            raise QuantError(f"{prefix}: the checkpoint's {', '.join(modules)} have {u.shape[0]} output features "
                             f"together; the layer has {layer.out_features}")
        scales = torch.cat([p[1] for p in parts]).contiguous()  # [N, K / G] float32
        zeros = torch.cat([p[2] for p in parts]).contiguous()  # [N, K / G] uint8
        if self.sym:
            mid = 2 ** (self.bits - 1)
            if not bool((zeros == mid).all()):
                found = zeros[zeros != mid].unique()[:4].tolist()
                raise QuantError(f"{prefix}: quantization_config.sym is true but the checkpoint's zero points of "
                                 f"{', '.join(modules)} are not all {mid} (found {found}); kiln stores symmetric "
                                 f"GPTQ without zero points and will not drop them")
            # kiln's symmetric offset is GPTQ's: 4-bit u = q + 8 as stored; 8-bit signed q = u - 128.
            out = {"qweight": pack_int4(u) if self.bits == 4 else (u.to(torch.int16) - mid).to(torch.int8)}
        else:
            out = {"qweight": pack_int4(u) if self.bits == 4 else u, "zeros": zeros}
        out["scales"] = scales
        if self.act_order:
            g_idx = [p[3] for p in parts]
            if any(not torch.equal(g, g_idx[0]) for g in g_idx[1:]):
                raise QuantError(f"{prefix}: the checkpoint's {', '.join(modules)} have different g_idx (act-order "
                                 f"groups); kiln's fused {prefix} takes one g_idx for all its parts")
            out["g_idx"] = g_idx[0]
        return out

    def _part(self, prefix: str, module: str, k: int, group: int,
              read: ReadTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One checkpoint module as (values [N_i, K] uint8, scales [N_i, K / G] float32, zero points
        [N_i, K / G] uint8 as v2 means them, g_idx [K] int32 when act_order)."""
        if f"{module}.qweight" not in self.names:
            stored = f" (it holds {module}.weight)" if f"{module}.weight" in self.names else ""
            raise QuantError(f"{prefix}: the checkpoint has no {module}.qweight{stored}; kiln quantizes {prefix} "
                             f"and needs each of its parts in GPTQ's layout")
        p = 32 // self.bits
        groups = k // group
        scales = read(f"{module}.scales")  # [K / G, N_i]
        n = scales.shape[-1] if scales.dim() == 2 else 0
        _check(f"{module}.scales", scales, SCALE_DTYPES, (groups, n))
        if n % p:
            raise QuantError(f"{module}.scales: {n} output features is not a multiple of {p}, as GPTQ's packing "
                             f"of {self.bits}-bit zero points needs")
        qweight = read(f"{module}.qweight")  # [K / p, N_i]
        _check(f"{module}.qweight", qweight, (torch.int32,), (k // p, n))
        qzeros = read(f"{module}.qzeros")  # [K / G, N_i / p]
        _check(f"{module}.qzeros", qzeros, (torch.int32,), (groups, n // p))
        if self.fmt == "gptq":  # v1: z - 1 was stored, as int32 arithmetic
            qzeros = ((qzeros.long() & 0xFFFFFFFF) + V1_ZERO_OFFSET[self.bits]) & 0xFFFFFFFF
        values = unpack_fields(qweight, self.bits).permute(1, 0, 2).reshape(n, k)  # [N_i, K / p, p] -> [N_i, K]
        zeros = unpack_fields(qzeros, self.bits).reshape(groups, n).t()  # [N_i, K / G]
        g_idx = None
        if self.act_order:
            g_idx = _plain_groups(k, self.group_size)
            if f"{module}.g_idx" in self.names:
                g_idx = _g_idx(f"{module}.g_idx", read(f"{module}.g_idx"), self.group_size)
                if g_idx.shape[0] != k:
                    raise QuantError(f"checkpoint tensor {module}.g_idx has {g_idx.shape[0]} entries; {prefix} has "
                                     f"{k} input features")
        return values.contiguous(), scales.float().t().contiguous(), zeros.contiguous(), g_idx


def unpack_fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Words [R, C] (int32, or int64 holding 32-bit words) -> their `bits`-wide fields uint8 [R, C, 32 / bits],
    field j = bits b*j .. b*j + b-1 (GPTQ's order: no interleave)."""
    fields = torch.empty(*packed.shape, 32 // bits, dtype=torch.uint8)
    for j in range(32 // bits):  # one shift at a time: no int32 copy 32 / bits times the checkpoint's size
        fields[..., j] = ((packed >> (bits * j)) & (2 ** bits - 1)).to(torch.uint8)
    return fields


def _check(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...]) -> None:
    if t.dtype not in dtypes or tuple(t.shape) != shape:
        raise QuantError(f"checkpoint tensor {name} is {t.dtype} {list(t.shape)}; GPTQ's layout has "
                         f"{' or '.join(str(d) for d in dtypes)} {list(shape)} there")
