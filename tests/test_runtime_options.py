"""RuntimeOptions is the one list of runtime options: each field reaches the engine through LLM, AsyncLLM,
`kiln serve` (flags -> ServeConfig.runtime -> the server's AsyncLLM) and the Triton model's parameters, and
every field has a flag."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from serve_util import ServerThread

from kiln.cli import main, make_parser
from kiln.runtime import LLM, AsyncLLM, RuntimeOptions, SamplingParams
from kiln.runtime.options import FIELD_NAMES
from kiln.runtime.speculative import SpeculativeConfig
from kiln.serve.tritonserver.repository import BackendParameters

# A value other than the default for every field, and the flags that ask for the same.
NON_DEFAULT = dict(device="cpu", max_batch_size=2, max_num_tokens=48, num_kv_blocks=9, enable_prefix_caching=False,
                   kv_cache_memory_fraction=0.5, cuda_graphs=False, async_scheduling=True, verify_checksums=False,
                   capacity_scheduler_policy="guaranteed_no_evict", speculative_config=SpeculativeConfig("ngram", 3),
                   enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3, kv_offloading_size=0.001,
                   kv_offloading_dir="kiln-kv-tier", kv_offloading_disk_size=0.5)
FLAGS = ["--device", "cpu", "--max-batch-size", "2", "--max-num-tokens", "48", "--num-kv-blocks", "9",
         "--no-enable-prefix-caching", "--kv-cache-memory-fraction", "0.5", "--no-cuda-graphs", "--async-scheduling",
         "--no-verify-checksums", "--capacity-scheduler-policy", "guaranteed_no_evict", "--speculative-mode", "ngram", "--num-speculative-tokens", "3",
         "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3",
         "--kv-offloading-size", "0.001", "--kv-offloading-dir", "kiln-kv-tier", "--kv-offloading-disk-size", "0.5"]
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2


class Loaded(Exception):
    """Raised by the stand-in create_engine once it has seen the options."""


@pytest.fixture
def seen(monkeypatch):
    """The options each LLM / AsyncLLM asked create_engine for (no engine is loaded)."""
    calls = []

    def fake_create_engine(engine_dir, options):
        calls.append(options)
        raise Loaded

    monkeypatch.setattr("kiln.runtime.engine.llm.create_engine", fake_create_engine)
    monkeypatch.setattr("kiln.runtime.engine.async_llm.create_engine", fake_create_engine)
    return calls


def test_the_fields_are_the_ones_that_exist():
    assert set(FIELD_NAMES) == set(NON_DEFAULT)
    assert RuntimeOptions(**NON_DEFAULT) == RuntimeOptions(**{**NON_DEFAULT, "speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3}})  # vLLM's dict form is stored as the config


@pytest.mark.parametrize("cls", [LLM, AsyncLLM])
def test_each_field_reaches_create_engine(cls, seen):
    with pytest.raises(Loaded):
        cls("e", **NON_DEFAULT)
    with pytest.raises(Loaded):
        cls("e", options=RuntimeOptions(**NON_DEFAULT))
    with pytest.raises(Loaded):  # keywords are set over options
        cls("e", options=RuntimeOptions(max_batch_size=7), **{**NON_DEFAULT, "max_batch_size": 2})
    assert seen == [RuntimeOptions(**NON_DEFAULT)] * 3


@pytest.mark.parametrize("cls", [LLM, AsyncLLM])
def test_an_unknown_keyword_is_a_type_error_listing_the_valid_ones(cls, seen):
    with pytest.raises(TypeError, match=r"'max_batch'.*max_batch_size, max_num_tokens"):
        cls("e", max_batch=4)
    assert seen == []


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_batch_size", 0, "max_batch_size=0 must be a positive integer"),
    ("num_kv_blocks", True, "num_kv_blocks=True must be a positive integer"),
    ("num_kv_blocks", 2**31, "num_kv_blocks=2147483648 exceeds"),
    ("kv_cache_memory_fraction", 2, r"kv_cache_memory_fraction=2 must be in \(0, 1\]"),
    ("speculative_config", "ngram", "speculative_config must be a SpeculativeConfig or a dict"),
])
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        RuntimeOptions(**{field: value})


def test_every_field_has_a_flag_and_every_runtime_flag_a_field():
    parser = argparse.ArgumentParser()
    from kiln.commands.runtime_args import SPECULATIVE_FLAGS, add_runtime_args
    add_runtime_args(parser)
    flags = {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}
    dests = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    speculative = {a.dest for a in parser._actions if set(a.option_strings) & set(SPECULATIVE_FLAGS)}
    assert dests - speculative == set(FIELD_NAMES) - {"speculative_config"}
    assert speculative and set(SPECULATIVE_FLAGS) <= flags
    for name in ("enable_prefix_caching", "cuda_graphs", "async_scheduling", "verify_checksums"):
        dashed = name.replace("_", "-")
        assert {f"--{dashed}", f"--no-{dashed}"} <= flags


def serve_config(monkeypatch, tmp_path, flags):
    """The ServeConfig `kiln serve --engine DIR FLAGS` would serve."""
    seen = []

    async def fake_serve(config):
        seen.append(config)

    monkeypatch.setattr("kiln.serve.server.serve", fake_serve)
    assert main(["serve", "--engine", str(tmp_path), *flags]) == 0
    return seen[0]


def test_serve_flags_reach_the_servers_engine(monkeypatch, tmp_path, seen):
    config = serve_config(monkeypatch, tmp_path, FLAGS)
    assert config.runtime == RuntimeOptions(**NON_DEFAULT)
    assert serve_config(monkeypatch, tmp_path, []).runtime == RuntimeOptions()
    import asyncio

    from kiln.serve.server import KilnServer
    with pytest.raises(Loaded):
        asyncio.run(KilnServer(config).start())
    assert seen == [RuntimeOptions(**NON_DEFAULT)]


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_other_commands_take_the_same_flags(command, seen, capsys):
    argv = {"generate": ["generate", "--prompt", "x"], "bench": ["bench", "latency"]}[command]
    args = make_parser().parse_args([*argv, "--engine", "e", *FLAGS])
    from kiln.commands.runtime_args import runtime_options
    assert runtime_options(args) == RuntimeOptions(**NON_DEFAULT)


def test_triton_parameters_reach_the_options():
    sys.path.insert(0, str(Path(__file__).parent / "triton_stub"))
    from kiln.serve.tritonserver.python_model import runtime_options_of

    params = BackendParameters.from_strings({"engine_dir": "/e", "enable_kv_cache_reuse": "false",
                                             "kv_cache_free_gpu_mem_fraction": "0.5",
                                             "batch_scheduler_policy": "guaranteed_no_evict"})
    assert runtime_options_of(params, "cpu", 2) == RuntimeOptions(device="cpu", max_batch_size=2,
                                                                  enable_prefix_caching=False,
                                                                  kv_cache_memory_fraction=0.5,
                                                                  capacity_scheduler_policy="guaranteed_no_evict")
    params = BackendParameters.from_strings({"engine_dir": "/e", "kv_cache_host_memory_bytes": str(3 * 2**29),
                                             "kv_offloading_dir": "/kv", "kv_offloading_disk_size": "2.5"})
    assert runtime_options_of(params, "cpu", None) == RuntimeOptions(
        device="cpu", kv_offloading_size=1.5, kv_offloading_dir="/kv", kv_offloading_disk_size=2.5)


def test_options_reach_a_real_engine(tiny_code_engine, tmp_path):
    options = RuntimeOptions(**{**NON_DEFAULT, "num_kv_blocks": 40, "kv_offloading_dir": str(tmp_path / "kv")})
    with LLM(tiny_code_engine, options=options) as llm:
        runtime = llm.engine.runtime
        assert (str(runtime.device), runtime.max_batch_size, runtime.max_num_tokens, runtime.num_kv_blocks,
                runtime.enable_prefix_caching, runtime.kv_cache_memory_fraction, runtime.cuda_graphs,
                runtime.async_scheduling, runtime.capacity_scheduler_policy) == \
            ("cpu", 2, 48, 40, False, 0.5, False, True, "guaranteed_no_evict")
        assert (runtime.kv_offloading_size, runtime.kv_offloading_dir, runtime.kv_offloading_disk_size) == (
            0.001, str(tmp_path / "kv"), 0.5)
        assert llm.engine.executor.num_host_kv_blocks > 0
        assert llm.engine.scheduler.policy.name == "guaranteed_no_evict"
        assert llm.speculation_stats() is not None  # the n-gram proposer is on


def hits_after_repeating_a_prompt(generate, stats) -> int:
    for _ in range(2):
        generate()
    return stats()["prefix_cache_hit_tokens"]


def test_no_enable_prefix_caching_turns_it_off_in_serve(monkeypatch, tmp_path, tiny_code_engine):
    with LLM(tiny_code_engine) as llm:  # the prompt does hit the cache when it is on
        params = SamplingParams(max_tokens=2)
        assert hits_after_repeating_a_prompt(lambda: llm.generate(PROMPT, params), llm.kv_cache_stats) > 0
    config = serve_config(monkeypatch, tmp_path, ["--no-enable-prefix-caching"])
    assert config.runtime.enable_prefix_caching is False
    server = ServerThread(replace(config, engine_dir=str(tiny_code_engine), http_port=0, grpc_port=0,
                                  metrics_port=0))
    try:
        def complete():
            body = json.dumps({"model": server.server.model_name, "prompt": PROMPT, "max_tokens": 2}).encode()
            request = urllib.request.Request(server.http_base + "/v1/completions", body,
                                             {"Content-Type": "application/json"})
            assert json.loads(urllib.request.urlopen(request, timeout=60).read())["choices"]
        assert hits_after_repeating_a_prompt(complete, server.kv_cache_stats) == 0
    finally:
        server.stop()
