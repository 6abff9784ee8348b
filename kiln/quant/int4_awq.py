"""`int4_awq`: INT4 AWQ weight-only (W4A16), calibrated with ModelOpt's INT4_AWQ_CFG ("awq_lite") at
block size `group_size`: symmetric per-group INT4 weights after AWQ's activation-aware scaling of their
input columns, whose inverse the layer applies to its input (`pre_quant_scale`, one per fused part)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from .registry import QuantScheme, register
from .weight_only_formats import WeightOnlyConfig, _PerPartSmoothing


@dataclass(frozen=True)
class Int4AwqConfig(WeightOnlyConfig, _PerPartSmoothing):
    bits: int = 4
    group_size: int | None = 128
    smoothed: bool = True

    def modelopt_config(self) -> dict[str, Any]:
        import modelopt.torch.quantization as mtq

        cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer":
                entry["cfg"]["block_sizes"] = {-1: self.group_size, "type": "static"}
        return cfg


register(QuantScheme("int4_awq", lambda p: Int4AwqConfig(group_size=p.group, selection=p.selection), order=3,
                     parameters=frozenset({"group_size"}), calibrated=True, grouped=True))
