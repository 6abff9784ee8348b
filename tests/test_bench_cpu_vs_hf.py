"""scripts/bench_cpu_vs_hf.py, the CPU comparison with transformers that docs/performance.md's table comes from: its mixed
workload's request lengths, and a short run of each workload (kiln and transformers agree token for token)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from serve_util import EXAMPLES

REPO = EXAMPLES.parent
SCRIPT = REPO / "scripts" / "bench_cpu_vs_hf.py"


def _script():
    spec = importlib.util.spec_from_file_location("bench_cpu_vs_hf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mixed_requests_spread_prompt_and_output_lengths():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(EXAMPLES / "kiln-tiny-code")
    prompts, outputs = _script().mixed_requests(tokenizer, 16, 128)
    assert [len(p) for p in prompts] == [16 + i * 368 // 15 for i in range(16)]  # 16 .. 384
    assert all(p[0] == tokenizer.bos_token_id for p in prompts)
    assert min(outputs) == 32 and max(outputs) == 256 and len(set(outputs)) == 16
    assert outputs != sorted(outputs)  # not in the prompts' order
    assert len({tuple(p[1:9]) for p in prompts}) == 16  # different windows of the sample


@pytest.mark.parametrize("workload", ["equal", "mixed"])
def test_short_run_prints_a_table_with_equal_outputs(tiny_code_engine, workload):
    out = subprocess.run([sys.executable, str(SCRIPT), "--engine", str(tiny_code_engine), "--checkpoint",
                          str(EXAMPLES / "kiln-tiny-code"), "--batch-sizes", "3", "--output-len", "8",
                          "--repeats", "1", "--threads", "1", "--workload", workload],
                         capture_output=True, text=True, timeout=600, cwd=REPO / "tests")
    assert out.returncode == 0, out.stderr[-2000:]
    row = out.stdout.strip().splitlines()[-1]
    assert row.startswith("| 3 |") and row.endswith("| 3/3 |"), out.stdout
