"""`kiln serve` as a whole: configuration, the engine service's accounting, metrics, graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from serve_util import MODEL_NAME, start_server

from kiln.cli import main
from kiln.runtime import SamplingParams
from kiln.serve.config import ServeConfig
from kiln.serve.errors import InvalidRequest, Unavailable


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


async def collect(service, prompt, params):
    async with contextlib.aclosing(service.generate(prompt, params)) as stream:
        return [delta async for delta in stream]


@pytest.mark.parametrize("field, value, message", [
    ("http_port", 70000, "http_port"),
    ("max_request_bytes", 10, "max_request_bytes"),
    ("api_key", "  ", "api_key is empty"),
    ("shutdown_timeout_s", -1.0, "shutdown_timeout_s"),
])
def test_serve_config_rejects_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(engine_dir="e", **{field: value})


def test_ports_must_differ():
    with pytest.raises(ValueError, match="ports must differ"):
        ServeConfig(engine_dir="e", http_port=9000, grpc_port=9000)


def test_deltas_add_up_and_metrics_count_them(server):
    service = server.service
    before = scrape(server.metrics_url)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    deltas = server.call(collect(service, "def add(a, b):", params))
    final = deltas[-1].output
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids and len(final.token_ids) == 8
    with pytest.raises(InvalidRequest, match="exceeds max_seq_len"):
        server.call(collect(service, "x = 1", SamplingParams(max_tokens=5000)))
    after = scrape(server.metrics_url)
    assert after['kiln_requests_total{outcome="length"}'] == before['kiln_requests_total{outcome="length"}'] + 1
    assert after['kiln_requests_total{outcome="rejected"}'] == before['kiln_requests_total{outcome="rejected"}'] + 1
    assert after["kiln_generation_tokens_total"] - before["kiln_generation_tokens_total"] == 8
    assert after["kiln_prompt_tokens_total"] - before["kiln_prompt_tokens_total"] == len(final.prompt_token_ids)
    assert after["kiln_time_to_first_token_seconds_count"] == before["kiln_time_to_first_token_seconds_count"] + 1
    assert after["kiln_inter_token_latency_seconds_count"] == before["kiln_inter_token_latency_seconds_count"] + 7
    assert after["kiln_e2e_request_latency_seconds_count"] == before["kiln_e2e_request_latency_seconds_count"] + 1
    assert after["kiln_kv_cache_free_blocks"] == after["kiln_kv_cache_blocks"]
    assert after["kiln_num_requests_running"] == 0 and after["kiln_kv_cache_usage_ratio"] == 0
    for name in ("kiln_prefix_cache_hit_rate", "kiln_prefix_cache_queried_tokens_total", "kiln_num_preemptions_total"):
        assert name in after


def test_a_consumer_that_stops_early_aborts_its_request(server):
    async def take_two():
        stream = server.service.generate("import os\n", SamplingParams(max_tokens=500, temperature=0.0,
                                                                       ignore_eos=True))
        async with contextlib.aclosing(stream):
            async for delta in stream:
                if len(delta.output.token_ids) >= 2:
                    break

    before = scrape(server.metrics_url)['kiln_requests_total{outcome="abort"}']
    server.call(take_two())
    stats = server.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == 0
    assert scrape(server.metrics_url)['kiln_requests_total{outcome="abort"}'] == before + 1


def test_stop_lets_running_requests_finish_and_refuses_new_ones(tiny_code_engine):
    s = start_server(tiny_code_engine, shutdown_timeout_s=60.0)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def scenario():
        running = asyncio.ensure_future(collect(s.service, "class Foo:", params))
        await asyncio.sleep(0.3)  # it is generating
        stopping = asyncio.ensure_future(s.server.stop())
        await asyncio.sleep(0.05)
        with pytest.raises(Unavailable):
            await collect(s.service, "x", params)
        deltas = await running
        await stopping
        return deltas

    deltas = s.call(scenario(), timeout=120)
    assert deltas[-1].finish_reason == "length" and len(deltas[-1].output.token_ids) == 40
    s.loop.call_soon_threadsafe(s.loop.stop)


def test_shutdown_timeout_aborts_what_is_still_running(tiny_code_engine):
    s = start_server(tiny_code_engine, shutdown_timeout_s=0.3)
    params = SamplingParams(max_tokens=1000 - 8, temperature=0.0, ignore_eos=True)

    async def scenario():
        running = asyncio.ensure_future(collect(s.service, "class Foo:", params))
        await asyncio.sleep(0.3)
        await s.server.stop()
        return await running

    deltas = s.call(scenario(), timeout=120)
    assert deltas[-1].finish_reason == "abort"
    s.loop.call_soon_threadsafe(s.loop.stop)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_kiln_serve_process_exits_0_on_sigterm(tiny_code_engine):
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", "--engine", str(tiny_code_engine),
                             "--model-name", MODEL_NAME, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        match = re.search(r"ready on http://127\.0\.0\.1:(\d+)", line)
        assert match, line + (proc.stdout.read() if proc.poll() is not None else "")
        port = int(match.group(1))
        line = proc.stdout.readline()  # no --chat-template: the bundled model's own
        assert line.strip() == "kiln serve: chat template: the engine's own (tokenizer/tokenizer_config.json)", line
        line = proc.stdout.readline()  # Llama: llama3_json; no --reasoning-parser
        assert line.strip() == ("kiln serve: chat answers: tool calls in llama3_json (the default for "
                                "LlamaForCausalLM); answers as written (--reasoning-parser reads <think>)"), line
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=10).status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_cli_errors_exit_2(tmp_path, tiny_code_engine, capsys):
    assert main(["serve", "--engine", str(tmp_path / "nowhere"), "--http-port", "0", "--grpc-port", "0",
                 "--metrics-port", "0"]) == 2
    assert capsys.readouterr().err.startswith("kiln serve: error: ")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.perf_counter()
        assert main(["serve", "--engine", str(tiny_code_engine), "--http-port", str(port), "--grpc-port", "0",
                     "--metrics-port", "0"]) == 2
        assert time.perf_counter() - start < 60
    err = capsys.readouterr().err
    assert "kiln serve: error: cannot listen" in err and str(port) in err
