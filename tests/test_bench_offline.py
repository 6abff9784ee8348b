"""`kiln bench latency` and `kiln bench throughput` on a tiny CPU engine: the table, the JSON, the errors."""

import json

import pytest
from model_factory import make_checkpoint

from kiln.bench.offline import BenchSpec, random_prompts, run_throughput
from kiln.cli import main
from kiln.runtime import LLM


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("bench") / "ckpt", tokenizer=False)[0]
    output = tmp_path_factory.mktemp("bench") / "engine"
    assert main(["build", "--checkpoint", str(checkpoint), "--output", str(output), "--max-batch-size", "4",
                 "--max-num-tokens", "64", "--max-seq-len", "128", "--kv-block-size", "8"]) == 0
    return output


def test_bench_latency_prints_a_table_and_writes_json(engine, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--engine", str(engine), "--input-len", "20", "--output-len", "6",
                 "--num-iters", "2", "--output", str(out)]) == 0
    table = capsys.readouterr().out
    for label in ("time to first token ms", "decode tokens/s", "inter-token latency ms p50 / p99",
                  "startup (load to ready) s", "CUDA graph capture s"):
        assert label in table
    result = json.loads(out.read_text())
    assert result["benchmark"] == "latency" and result["device"] == "cpu"
    assert result["spec"]["input_len"] == 20 and result["spec"]["output_len"] == 6
    assert result["ttft_ms"] > 0 and result["decode_tokens_per_s"] > 0
    assert result["itl_p99_ms"] >= result["itl_p50_ms"] > 0
    assert result["memory"]["num_kv_blocks"] == result["num_kv_blocks"] > 0


def test_bench_throughput_counts_every_token(engine, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--engine", str(engine), "--input-len", "12", "--output-len", "5",
                 "--num-requests", "9", "--output", str(out)]) == 0
    assert "output tokens/s" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["output_tokens"] == 9 * 5  # EOS ignored: every request runs to --output-len
    assert result["total_tokens_per_s"] == pytest.approx(result["output_tokens_per_s"] * (12 + 5) / 5)


def test_throughput_leaves_the_cache_free(engine):
    llm = LLM(engine)
    run_throughput(llm, BenchSpec(input_len=30, output_len=4, num_requests=7))
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]


def test_random_prompts_are_seeded_and_in_the_vocabulary():
    a, b = random_prompts(3, 50, 100, seed=1), random_prompts(3, 50, 100, seed=1)
    assert a == b and a != random_prompts(3, 50, 100, seed=2)
    assert all(0 <= t < 100 for p in a for t in p) and [len(p) for p in a] == [50] * 3


@pytest.mark.parametrize("args, message", [
    (["--input-len", "0"], "--input-len 0 must be a positive integer"),
    (["--output-len", "200"], "exceeds max_seq_len 128"),
    (["--kv-cache-memory-fraction", "1.5"], "--kv-cache-memory-fraction 1.5 must be in (0, 1]"),
])
def test_bench_bad_arguments_exit_2_naming_them(engine, args, message, capsys):
    assert main(["bench", "latency", "--engine", str(engine), *args]) == 2
    assert message in capsys.readouterr().err
