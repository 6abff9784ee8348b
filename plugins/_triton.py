"""Whether the Triton GPU kernels are registered for CUDA tensors.

They are when the `triton` package is importable and `KILN_DISABLE_TRITON` is not set to 1; otherwise
CUDA tensors run the PyTorch references too (slow, but correct), which is also how the GPU tests compare
a whole engine on the references against the kernels. Kernel modules (`triton_*.py`) import triton at
the top, so import them only when `USE_TRITON` is true.
"""

from __future__ import annotations

import importlib.util
import os

USE_TRITON = importlib.util.find_spec("triton") is not None and os.environ.get("KILN_DISABLE_TRITON", "0") != "1"
