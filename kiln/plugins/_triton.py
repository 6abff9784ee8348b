"""Whether the Triton GPU kernels are registered for CUDA tensors.

They are when the `triton` package is importable and `KILN_DISABLE_TRITON` is not set to 1; otherwise
CUDA tensors run the PyTorch references too (slow, but correct), which is also how the GPU tests compare
a whole engine on the references against the kernels. Kernel modules (`triton_*.py`) import triton at
the top, so import them only when `USE_TRITON` is true.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

USE_TRITON = importlib.util.find_spec("triton") is not None and os.environ.get("KILN_DISABLE_TRITON", "0") != "1"


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors, which the kernels' launch heuristics size their grids by; 132 (an
    H100's) for CPU tensors, i.e. under Triton's interpreter."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count
