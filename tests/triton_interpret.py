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
