"""One way to make a model's network, shared by the builder (on meta, for names, shapes and dtypes) and
the runtime loader (on meta, then weights assigned from the engine file)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .config import ModelConfig
from .layers.linear import LinearFactory
from .layers.parallel import TPComm
from .protocol import CausalLM
from .registry import ModelDef

if TYPE_CHECKING:
    from kiln.engine_format.mapping import Mapping
    from kiln.quant.base import QuantConfig


def build_network(model_def: ModelDef, config: ModelConfig, quant: QuantConfig | None = None,
                  mapping: Mapping | None = None, *, dtype: torch.dtype = torch.float32,
                  comm: TPComm | None = None) -> CausalLM:
    """The network of `model_def` for `config`, on the current default device (wrap the call in
    `with torch.device("meta"):` to allocate nothing).

    Every unquantized floating tensor is created in `dtype`; `quant` picks each linear layer's method
    (and so its tensors' dtypes); `mapping` says which tensor-parallel rank this network is, and `comm` is
    its group's collectives (the runtime's; None for the builder's networks, which never run). Tensors are
    uninitialized: the engine file or a checkpoint supplies them.
    """
    linears = LinearFactory(quant=quant, mapping=mapping, dtype=dtype, comm=comm)
    model = model_def.model_class(config, linears, model_def.mlp)
    if not isinstance(model, CausalLM):
        raise TypeError(f"{model_def.architecture}: {type(model).__name__} does not implement CausalLM")
    return model
