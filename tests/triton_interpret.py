"""Runs a Triton kernel check on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

The interpreter is chosen when a kernel is decorated, i.e. when its module is imported; kiln imports its
kernel modules at import time when triton is installed, so a check needs a fresh interpreter process with
the variable set before anything imports triton. The check is a Python script that raises (an assert) on
a mismatch; its output comes back in the failure message.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def run_interpreted(script: str, timeout: float = 600) -> str:
    """Runs `script` (dedented) in a new Python with TRITON_INTERPRET=1; returns its stdout, fails the test
    with its output when it exits non-zero."""
    env = dict(os.environ, TRITON_INTERPRET="1", KILN_DISABLE_TRITON="0")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode:
        pytest.fail(f"interpreted kernel check failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


# A script prelude (run_interpreted's scripts start with it to run a whole engine through the GPU path on the CPU):
# every op with a CUDA kernel calls that kernel for CPU tensors too (Triton's interpreter runs it), and the
# wrappers stop taking their reference shortcut for CPU tensors (plan-less, as on CUDA). `KERNELS_RAN` collects
# the names of the ops whose kernel ran.
KERNELS_FOR_CPU_TENSORS = """
import importlib as _importlib
import pkgutil as _pkgutil

import kiln.plugins as _plugins
from kiln.plugins import _eager

KERNELS_RAN = set()


def _kernel_for_tensor(self, t):
    kernel = self._kernels.get("cuda")
    if kernel is None:
        return self.reference
    KERNELS_RAN.add(self.name)
    return kernel


_eager.KernelOp.for_tensor = _kernel_for_tensor
for _info in _pkgutil.iter_modules(_plugins.__path__):
    _module = _importlib.import_module(f"kiln.plugins.{_info.name}")
    if hasattr(_module, "runs_reference_directly"):
        _module.runs_reference_directly = lambda t: False
"""
