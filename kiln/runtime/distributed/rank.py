"""What every rank of a tensor-parallel engine does to start: pick its device, join the groups, load its
weights with its collectives, and build its model runner (the KV-block count agreed over ranks)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from kiln.engine_format import Mapping
from kiln.runtime.distributed.comm import TorchTPComm
from kiln.runtime.distributed.group import RankGroups
from kiln.runtime.distributed.launch import RankLaunch, rank_device
from kiln.runtime.worker.engine_loader import EngineInfo, RuntimeConfig, load_network
from kiln.runtime.worker.executor import runner_limits
from kiln.runtime.worker.model_runner import ModelRunner

logger = logging.getLogger("kiln.runtime")


def rank_runtime(runtime: RuntimeConfig, launch: RankLaunch, engine_dir: object) -> RuntimeConfig:
    """The runtime config with this rank's device. On the CPU, ranks on one host split its cores."""
    device = rank_device(runtime.device, launch, engine_dir)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // launch.local_world_size))
    return dataclasses.replace(runtime, device=device)


def join(runtime: RuntimeConfig, launch: RankLaunch, secret: str | None = None) -> RankGroups:
    """Meets the other ranks (`secret`: the launch's, read from KILN_TP_SECRET when None)."""
    return RankGroups(launch, runtime.device, secret)


def start_runner(info: EngineInfo, runtime: RuntimeConfig, groups: RankGroups,
                 kv_cache_scales: Sequence[tuple[float, float]] | None) -> ModelRunner:
    """This rank's network and runner (with LoRA slots for this rank's slice of each adapter under
    enable_lora); collective with the other ranks (they must call it too)."""
    mapping: Mapping = info.config.mapping.for_rank(groups.rank)
    comm = TorchTPComm(groups.device_group, mapping.tp_size, mapping.tp_rank)
    model = load_network(info, runtime.device, groups.rank, comm=comm)
    return ModelRunner(model, device=runtime.device, kv_cache_dtype=runtime.cache_dtype,
                       limits=runner_limits(runtime, mapping.tp_size),
                       kv_cache_scales=kv_cache_scales, mapping=mapping, agree_num_blocks=groups.min_over_ranks)
