"""`kiln bench serve` against a real kiln server (the OpenAI endpoints)."""

from __future__ import annotations

import json
import math

import pytest

from kiln.bench.serve_client import BenchConfig, make_prompts
from kiln.cli import main


@pytest.mark.parametrize("endpoint, rate", [("completions", "inf"), ("chat", "50")])
def test_bench_serve_reports_latencies_and_throughput(server, tmp_path, capsys, endpoint, rate):
    out = tmp_path / "bench.json"
    assert main(["bench", "serve", "--url", server.http_base, "--request-rate", rate, "--num-prompts", "6",
                 "--input-len", "16", "--output-len", "6", "--endpoint", endpoint, "--output", str(out)]) == 0
    table = capsys.readouterr().out
    assert "time to first token (ms)" in table and "output token throughput" in table
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["completion_tokens"] == 36  # ignore_eos: every request runs to output-len
    assert result["prompt_tokens"] >= 6 * 16
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert result[key]["p50"] > 0 and result[key]["p99"] >= result[key]["p50"]
    assert result["output_token_throughput"] > 0 and result["request_throughput"] > 0
    stats = server.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]


def test_prompts_are_seeded():
    config = BenchConfig(url="http://x", num_prompts=3, request_rate=math.inf, input_len=10)
    assert make_prompts(config) == make_prompts(config) and len(make_prompts(config)[0].split()) == 10


@pytest.mark.parametrize("args, message", [
    (["--request-rate", "0", "--num-prompts", "1"], "--request-rate"),
    (["--request-rate", "1", "--num-prompts", "0"], "--num-prompts"),
])
def test_bad_arguments_exit_2(args, message, capsys):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", *args]) == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_exits_2(capsys):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--request-rate", "inf", "--num-prompts", "1"]) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
