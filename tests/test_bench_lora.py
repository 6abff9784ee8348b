"""`kiln bench throughput|latency --enable-lora --lora-modules name=DIR ... --num-loras K` on the bundled
kiln-tiny-code with real PEFT adapters (rank 16, all-linear): the run uses K adapters round-robin and reports
them, and bad LoRA flags exit 2 naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from lora_util import make_adapter

from kiln.bench.lora import BenchLoRA, bench_loras
from kiln.cli import main
from kiln.runtime import LoRARequest

pytest.importorskip("peft")

BUNDLED = Path(__file__).resolve().parent.parent / "examples" / "kiln-tiny-code"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> list[str]:
    """Two rank-16 all-linear adapters, as --lora-modules values."""
    root = tmp_path_factory.mktemp("bench-lora")
    base = transformers.AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    return [f"{name}={make_adapter(base, root / name, seed=i, r=16, lora_alpha=32, target_modules='all-linear')[0]}"
            for i, name in enumerate(("a", "b"))]


@pytest.mark.parametrize("num_loras", [0, 1, 2])
def test_bench_throughput_runs_and_reports_the_adapters(tiny_code_engine, adapters, num_loras, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--engine", str(tiny_code_engine), "--input-len", "8", "--output-len", "4",
                 "--num-requests", "6", "--enable-lora", "--lora-modules", *adapters,
                 "--num-loras", str(num_loras), "--output", str(out)]) == 0
    assert f"LoRA adapters (round-robin)  {num_loras} (" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["output_tokens"] == 6 * 4
    lora = result["lora"]
    assert lora["enable_lora"] is True and lora["num_loras"] == num_loras
    assert [a["name"] for a in lora["adapters"]] == ["a", "b"][:num_loras]
    assert lora["stats"]["host_adapters"] == num_loras  # each used adapter read once, none for K = 0


def test_bench_latency_runs_each_adapter(tiny_code_engine, adapters, tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--engine", str(tiny_code_engine), "--input-len", "8", "--output-len", "3",
                 "--num-iters", "2", "--enable-lora", "--lora-modules", *adapters, "--output", str(out)]) == 0
    lora = json.loads(out.read_text())["lora"]
    assert lora["num_loras"] == 2 and lora["stats"]["host_adapters"] == 2


def test_without_lora_the_result_says_so(tiny_code_engine, tmp_path):
    out = tmp_path / "plain.json"
    assert main(["bench", "throughput", "--engine", str(tiny_code_engine), "--input-len", "8", "--output-len", "2",
                 "--num-requests", "2", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["lora"] == {"enable_lora": False, "num_loras": 0, "adapters": [],
                                                   "stats": None}


@pytest.mark.parametrize("flags, message", [
    (["--lora-modules", "a=ADAPTER"], "--lora-modules and --num-loras need --enable-lora"),
    (["--enable-lora", "--lora-modules", "a=ADAPTER", "--num-loras", "2"],
     "--num-loras 2 exceeds the 1 adapter(s) given by --lora-modules"),
    (["--enable-lora", "--num-loras", "-1"], "--num-loras -1 must be >= 0"),
    (["--enable-lora", "--lora-modules", "a=/no/such/dir"], "--lora-modules a=/no/such/dir: /no/such/dir is not a"),
    (["--enable-lora", "--lora-modules", "a=ADAPTER", "a=ADAPTER"], "the name 'a' is given twice"),
    (["--enable-lora", "--lora-modules", "nopath"], "--lora-modules 'nopath': must be name=path"),
])
def test_bad_lora_flags_exit_2_naming_the_flag(tiny_code_engine, adapters, flags, message, capsys):
    flags = [adapters[0].split("=", 1)[1].join(f.split("ADAPTER")) if "ADAPTER" in f else f for f in flags]
    message = message.replace("ADAPTER", adapters[0].split("=", 1)[1])
    assert main(["bench", "throughput", "--engine", str(tiny_code_engine), "--num-requests", "1", *flags]) == 2
    assert message in capsys.readouterr().err


def test_round_robin_over_the_first_k():
    loras = bench_loras([("a", "."), ("b", "."), ("c", ".")], 2, enable_lora=True)
    a, b = LoRARequest("a", 1, "."), LoRARequest("b", 2, ".")
    assert loras.assign(5) == [a, b, a, b, a] and loras.assign(2, offset=1) == [b, a]
    assert BenchLoRA().assign(3) == [None] * 3
    assert bench_loras([("a", ".")], None, enable_lora=True).adapters == (LoRARequest("a", 1, "."),)
    assert bench_loras([], None, enable_lora=True).adapters == ()
