"""When a wrapper may call an operator's PyTorch reference directly instead of going through torch.library.

On the CPU the registered implementation *is* the reference, but the dispatcher's path to it (schema
handling, the in-place/view bookkeeping of mutating ops, the dynamo guard) costs tens of microseconds a
call: a fifth of a small model's CPU decode step. Plain eager CPU tensors skip it; anything that traces
(torch.compile, fake or functional tensors) and every CUDA tensor still sees the op.
"""

from __future__ import annotations

import torch


def runs_reference_directly(t: torch.Tensor) -> bool:
    """Whether an op on `t` (its first tensor argument) may call its reference without dispatch."""
    return type(t) is torch.Tensor and t.is_cpu and not torch.compiler.is_compiling()
