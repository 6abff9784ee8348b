"""`--dtype auto`: the checkpoint's dtype, except on a CPU without native support for a 16-bit dtype."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from kiln.builder.build import cpu_flags, load_model_config, resolve_dtype

AVX512_BF16 = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16"})
AVX2_ONLY = frozenset({"fpu", "avx2", "fma"})


BUNDLED = load_model_config(Path(__file__).parent.parent / "examples" / "kiln-tiny-code")[1]


def _config(torch_dtype):
    return dataclasses.replace(BUNDLED, torch_dtype=torch_dtype)


@pytest.mark.parametrize(("checkpoint", "device", "flags", "expected"), [
    ("bfloat16", "cpu", AVX2_ONLY, "float32"),  # bf16 without native support: float32 is faster
    ("bfloat16", "cpu", AVX512_BF16, "bfloat16"),
    ("bfloat16", "cpu", frozenset({"amx_bf16"}), "bfloat16"),
    ("bfloat16", "cpu", frozenset({"fp", "asimd", "bf16"}), "bfloat16"),  # Arm (Graviton 3)
    ("float16", "cpu", AVX512_BF16, "float32"),
    ("float16", "cpu", frozenset({"avx512_fp16"}), "float16"),
    ("bfloat16", "cpu", frozenset(), "float32"),  # flags unknown (no /proc/cpuinfo)
    ("bfloat16", "cuda", AVX2_ONLY, "bfloat16"),  # GPUs keep the checkpoint's dtype
    ("float16", "cuda", frozenset(), "float16"),
    ("float32", "cpu", AVX2_ONLY, "float32"),
    (None, "cpu", AVX512_BF16, "float32"),  # no dtype named
])
def test_auto(checkpoint, device, flags, expected, caplog):
    with caplog.at_level(logging.INFO, logger="kiln.builder"):
        assert resolve_dtype("auto", _config(checkpoint), device, flags) == expected
    assert f"--dtype auto for {device}: {expected} (" in caplog.text


def test_explicit_dtype_wins():
    assert resolve_dtype("bfloat16", _config("float32"), "cpu", AVX2_ONLY) == "bfloat16"


def test_cpu_flags(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
