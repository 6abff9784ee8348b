"""What a pre-quantized checkpoint's reader gives the builder.

`kiln build` asks `detect_checkpoint_quantization` (detect.py) for a `CheckpointQuantization`; one exists
per format (modelopt.py, compressed_tensors.py, fp8_block.py, awq.py, gptq.py). It says which kiln scheme the
engine gets (`quant_spec`, recorded in engine.json and used by the runtime to build the same network),
makes each quantized layer's engine tensors from the checkpoint's tensors of its parts exactly
(`layer_tensors`: q, k and v each with their own scales), and reads the KV-cache scales if the checkpoint
has them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from kiln.model_defs.layers.linear import Linear
from kiln.quant.base import QuantError
from kiln.quant.spec import QuantSpec

# checkpoint tensor name -> tensor (lazily read from the checkpoint's files); KeyError for one it lacks
ReadTensor = Callable[[str], torch.Tensor]


class CheckpointQuantization(ABC):
    """One pre-quantized checkpoint's format, ready to read its layers."""

    name: str  # e.g. "ModelOpt FP8 (hf_quant_config.json)": in logs, errors and engine.json's `source`

    @abstractmethod
    def quant_spec(self) -> QuantSpec:
        """The engine's quantization: a kiln scheme (qformat, group size, ...) with `source` = `name`."""

    @abstractmethod
    def layer_tensors(self, prefix: str, layer: Linear, modules: Sequence[str],
                      read: ReadTensor) -> dict[str, torch.Tensor]:
        """The engine tensors of the quantized layer `prefix` (every tensor its method declares but `bias`),
        from the checkpoint modules `modules` it is made of, in row order (…q_proj, …k_proj, …v_proj)."""

    @abstractmethod
    def module_tensors(self, module: str) -> tuple[str, ...]:
        """The checkpoint tensor names a quantized module may be stored as (its weight and scales), which the
        builder does not report as unused; `layer_tensors` names any it needs and cannot find."""

    def reorder_rows(self, prefix: str, tensors: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
        """`layer_tensors`' result with the layer's output rows in `order` ([N] int64: engine row i is checkpoint
        row order[i]), for a model that reorders a layer's rows at build (DeepSeek's rope rows). QuantError
        unless the format can do it exactly; none can by default."""
        raise QuantError(f"{prefix}: the model reorders this layer's rows at build, which kiln cannot do exactly "
                         f"for {self.name}")

    def kv_cache_scales(self, read: ReadTensor, names: set[str],
                        num_layers: int) -> tuple[str, list[tuple[float, float]]] | None:
        """(kv_cache_dtype, per layer (k_scale, v_scale)) when the checkpoint quantizes the KV cache."""
        return None

    def kv_scale_tensors(self, num_layers: int) -> tuple[str, ...]:
        """The KV-cache scale tensor names, so they are not reported as unused."""
        return ()
