"""Tensor-parallel engines on torch.distributed: one process per rank, NCCL between GPUs, gloo on CPUs.

`launch.py` decides where the ranks come from (started here, or a `torchrun` launch that started this
process), `store.py` is where they meet and how each proves the launch's secret (KILN_TP_SECRET), `group.py`
joins them into process groups, `comm.py` gives the network its collectives, `step_codec.py` is what crosses
the step channel (checked JSON, never pickles), `executor.py` is rank 0's `Executor` and `worker.py` every
other rank's step loop; `lora_sync.py` keeps the LoRA adapters every rank holds in step with rank 0's.
"""

from kiln.runtime.distributed.executor import TPExecutor
from kiln.runtime.distributed.launch import RankLaunch, launch_from_env

__all__ = ["RankLaunch", "TPExecutor", "launch_from_env"]
