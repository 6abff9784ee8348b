"""AutoAWQ checkpoints (config.json `quantization_config.quant_method: "awq"`, version "gemm"), read exactly into
kiln's asymmetric INT4 weight-only engine tensors.

The GEMM layout, as AutoAWQ's WQLinear_GEMM packs it (awq/modules/linear/gemm.py `from_linear`) and unpacks it
(awq/utils/packing_utils.py `dequantize_gemm`; vLLM's and GPTQModel's AWQ kernels read it the same way), for a
linear layer of `in` inputs and `out` outputs with groups of G input columns (group_size -1: G = in):
- qweight: int32 [in, out / 8]. Word [k, c] holds input row k of the 8 output columns 8c .. 8c + 7, interleaved:
  its nibble i (bits 4i .. 4i + 3) is output column 8c + AWQ_ORDER[i], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7].
- qzeros: int32 [in / G, out / 8], packed the same way: each group's zero point, 0..15.
- scales: float16 [in / G, out].
- weight[o, k] = (q[k, o] - z[k // G, o]) * s[k // G, o]: unsigned 4-bit values with a zero point per group,
  which is kiln's asymmetric INT4 (quant/weight_only.py): qweight [out, in / 2] uint8 from pack_int4,
  scales [out, in / G] float32 (fp16 widens exactly), zeros [out, in / G] uint8.
A fused kiln layer ([q; k; v], [gate; up]) concatenates its parts' rows, each with its own scales and zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kiln.checkpoints.prequant.base import CheckpointQuantization, ReadTensor
from kiln.model_defs.layers.linear import Linear
from kiln.plugins.int4_pack import pack_int4
from kiln.quant.base import QuantError
from kiln.quant.selection import DEFAULT_EXCLUDED
from kiln.quant.spec import QuantSpec

PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(j) for j in range(PACK))  # column j is in nibble (0, 4, 1, 5, 2, 6, 3, 7)[j]
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# AutoAWQ's other layouts: kiln reads none of them.
OTHER_VERSIONS = "gemv, gemv_fast, marlin, exllama, exllama_v2, ipex, llm-awq"


def from_checkpoint(checkpoint: Path, quantization_config: dict[str, Any], hf_quant_config: dict[str, Any] | None,
                    names: set[str]) -> AwqGemmCheckpoint:
    """The reader of an AutoAWQ GEMM checkpoint; QuantError (naming the config field, its value and what kiln
    reads) for any other AWQ layout or setting."""
    where = f"{checkpoint / 'config.json'}: quantization_config"
    if hf_quant_config is not None:
        raise QuantError(f"{where} says AWQ but the checkpoint also has ModelOpt's hf_quant_config.json; kiln will "
                         f"not guess which of the two its tensors follow")
    config = quantization_config
    version = str(config.get("version") or config.get("format") or "gemm").lower()
    if version != "gemm":
        raise QuantError(f"{where}.version={version!r} is an AWQ layout kiln does not read; kiln reads AutoAWQ's "
                         f"GEMM layout (version \"gemm\") only, not {OTHER_VERSIONS}")
    if str(config.get("backend") or "").lower() == "llm-awq":
        raise QuantError(f"{where}.backend='llm-awq' packs weights as llm-awq's GEMV kernels do; kiln reads AutoAWQ's "
                         f"GEMM layout (version \"gemm\") only")
    bits = config.get("bits", config.get("w_bit", 4))
    if bits != 4 or isinstance(bits, bool):
        raise QuantError(f"{where}.bits={bits!r} is not a width kiln reads from AWQ; kiln reads 4-bit AutoAWQ GEMM "
                         f"checkpoints (the GEMM layout packs 4-bit values only)")
    zero_point = config.get("zero_point", True)
    if zero_point is not True:
        raise QuantError(f"{where}.zero_point={zero_point!r}: kiln reads AWQ with zero points (zero_point: true) "
                         f"only; AutoAWQ's GEMM layout always stores qzeros, and what they mean without zero "
                         f"points is not defined")
    group_size = _group_size(config.get("group_size", config.get("q_group_size", 128)), where)
    skipped = config.get("modules_to_not_convert") or []
    if not isinstance(skipped, list) or not all(isinstance(m, str) for m in skipped):
        raise QuantError(f"{where}.modules_to_not_convert={skipped!r} must be a list of module names")
    # AutoAWQ leaves a linear layer unquantized when any of these names is a substring of its path.
    exclude = (*DEFAULT_EXCLUDED, *(f"*{m}*" for m in skipped if m not in DEFAULT_EXCLUDED))
    return AwqGemmCheckpoint(group_size, exclude, frozenset(names))


def _group_size(value: Any, where: str) -> int | None:
    """config group_size -> kiln's (None: one group per row)."""
    if value == -1:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 2 or value % 2:
        raise QuantError(f"{where}.group_size={value!r}: kiln reads AWQ groups of an even number of input columns "
                         f"(e.g. 32, 64, 128) or -1 (per channel)")
    return value


class AwqGemmCheckpoint(CheckpointQuantization):
    """AutoAWQ GEMM, 4-bit with zero points; `group_size` None is per channel."""

    def __init__(self, group_size: int | None, exclude_modules: tuple[str, ...], names: frozenset[str]) -> None:
        self.group_size = group_size
        self.exclude_modules = exclude_modules
        self.names = names
        self.name = f"AutoAWQ GEMM (INT4, {'per channel' if group_size is None else f'group {group_size}'}, zero point)"

    def quant_spec(self) -> QuantSpec:
        return QuantSpec(qformat="weight_only", kv_cache_dtype="auto", group_size=self.group_size,
                         exclude_modules=self.exclude_modules, bits=4, zero_point=True, source=self.name)

    def module_tensors(self, module: str) -> tuple[str, ...]:
        return f"{module}.qweight", f"{module}.qzeros", f"{module}.scales"

    def layer_tensors(self, prefix: str, layer: Linear, modules: Sequence[str],
                      read: ReadTensor) -> dict[str, torch.Tensor]:
        k = layer.in_features
        group = self.group_size or k
        if k % group:
            raise QuantError(f"{prefix}: in_features {k} is not divisible by the checkpoint's AWQ group size {group}")
        values, scales, zeros = [], [], []
        for module in modules:
            u, s, z = self._part(prefix, module, k, group, read)
            values.append(u)
            scales.append(s)
            zeros.append(z)
        u = torch.cat(values)  # [N, K] uint8
        if u.shape[0] != layer.out_features:
            raise QuantError(f"{prefix}: the checkpoint's {', '.join(modules)} have {u.shape[0]} output features "
                             f"together; the layer has {layer.out_features}")
        return {"qweight": pack_int4(u), "scales": torch.cat(scales).contiguous(),
                "zeros": torch.cat(zeros).contiguous()}

    def _part(self, prefix: str, module: str, k: int, group: int,
              read: ReadTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One checkpoint module as (values [N_i, K] uint8 0..15, scales [N_i, K / G] float32, zeros
        [N_i, K / G] uint8)."""
        if f"{module}.qweight" not in self.names:
            stored = f" (it holds {module}.weight)" if f"{module}.weight" in self.names else ""
            raise QuantError(f"{prefix}: the checkpoint has no {module}.qweight{stored}; kiln quantizes {prefix} "
                             f"and needs each of its parts in AWQ's layout")
        groups = k // group
        scales = read(f"{module}.scales")  # [K / G, N_i]
        n = scales.shape[-1] if scales.dim() == 2 else 0
        _check(f"{module}.scales", scales, SCALE_DTYPES, (groups, n))
        if n % PACK:
            raise QuantError(f"{module}.scales: {n} output features is not a multiple of {PACK}, as AWQ's packing "
                             f"needs")
        qweight = read(f"{module}.qweight")  # [K, N_i / 8]
        _check(f"{module}.qweight", qweight, (torch.int32,), (k, n // PACK))
        qzeros = read(f"{module}.qzeros")  # [K / G, N_i / 8]
        _check(f"{module}.qzeros", qzeros, (torch.int32,), (groups, n // PACK))
        return (unpack_awq(qweight).t().contiguous(), scales.float().t().contiguous(),
                unpack_awq(qzeros).t().contiguous())


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM words int32 [R, C] -> their 4-bit values uint8 [R, 8C], in column order (AWQ_ORDER undone)."""
    nibbles = torch.empty(*packed.shape, PACK, dtype=torch.uint8)  # [R, C, 8]: nibble i = column AWQ_ORDER[i]
    for i in range(PACK):  # one shift at a time: no int32 copy 8 times the checkpoint's size
        nibbles[..., i] = ((packed >> (4 * i)) & 0xF).to(torch.uint8)
    return nibbles[..., list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)


def _check(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...]) -> None:
    if t.dtype not in dtypes or tuple(t.shape) != shape:
        raise QuantError(f"checkpoint tensor {name} is {t.dtype} {list(t.shape)}; AWQ's GEMM layout has "
                         f"{' or '.join(str(d) for d in dtypes)} {list(shape)} there")
