"""The collectives a tensor-parallel network calls (`model_defs.layers.parallel.TPComm`), over one
engine's own group (`own_group.OwnGroup`): NCCL on GPUs, where CUDA graphs capture them; gloo on CPUs."""

from __future__ import annotations

import torch

from kiln.runtime.distributed.own_group import OwnGroup


class TorchTPComm:
    """`group`'s collectives for the network of rank `tp_rank` of `tp_size`."""

    def __init__(self, group: OwnGroup, tp_size: int, tp_rank: int) -> None:
        self.group = group
        self.tp_size = tp_size
        self.tp_rank = tp_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # In place: the row-parallel output is a fresh tensor that nothing else holds.
        self.group.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, C] -> gathered [tp, N, C] (rank order) -> [N, tp * C]
        n, c = x.shape
        gathered = torch.empty(self.tp_size * n, c, dtype=x.dtype, device=x.device)
        self.group.all_gather_into(gathered, x.contiguous())
        return gathered.view(self.tp_size, n, c).permute(1, 0, 2).reshape(n, self.tp_size * c)
