"""Speculative decoding through the Triton model: `kiln triton-repo --speculative-mode ... --speculative-model ...`
writes config.pbtxt's `speculative_config` (a JSON object, the model's path absolute), model.py hands it to the
runtime, and a real Triton Inference Server serves the greedy completions decoding without speculation gives, with
TensorRT-LLM's draft-count outputs filled. Bad values are refused when the repository is written, naming them."""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from pathlib import Path

import pytest

from kiln.runtime import RuntimeOptions
from kiln.runtime.speculative import SpeculativeConfig
from kiln.serve.tritonserver.repository import BackendParameters, write_repository

HEAD = Path(__file__).resolve().parents[1] / "examples" / "kiln-tiny-code-eagle3"


def _parameters(model_dir: Path) -> dict[str, str]:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())
    return {k: v.string_value for k, v in config.parameters.items()}


def test_the_flags_reach_config_pbtxt_and_the_runtime(tiny_code_engine, tmp_path, monkeypatch, capsys):
    from kiln.cli import main

    sys.path.insert(0, str(Path(__file__).parent / "triton_stub"))
    from kiln.serve.tritonserver.python_model import runtime_options_of

    monkeypatch.chdir(HEAD.parent)  # a relative head path, made absolute: tritonserver runs elsewhere
    argv = ["triton-repo", "--engine", str(tiny_code_engine), "--output", str(tmp_path / "repo"), "--model-name", "m",
            "--speculative-mode", "eagle3", "--speculative-model", HEAD.name, "--num-speculative-tokens", "3",
            "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"]
    assert main(argv) == 0
    values = _parameters(tmp_path / "repo" / "m")
    assert json.loads(values["speculative_config"]) == {
        "method": "eagle3", "num_speculative_tokens": 3, "model": str(HEAD), "eagle_topk": 2, "num_draft_tokens": 6}
    want = SpeculativeConfig("eagle3", 3, str(HEAD), eagle_topk=2, num_draft_tokens=6)
    assert runtime_options_of(BackendParameters.from_strings(values), "cpu", None) == RuntimeOptions(
        device="cpu", speculative_config=want)
    # Without the flags: no parameter, no speculation.
    assert main([*argv[:7], "--force"]) == 0
    assert "speculative_config" not in _parameters(tmp_path / "repo" / "m")
    capsys.readouterr()
    assert main([*argv[:7], "--force", "--speculative-mode", "eagle3"]) == 2
    assert "--speculative-mode eagle3 needs --speculative-model DIR" in capsys.readouterr().err


@pytest.mark.parametrize("text, error", [
    ("{", "is not JSON"),
    ('["ngram"]', "must be a JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "depth": 2}', "unknown keys ['depth']"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "--num-speculative-tokens 0 must be"),
    ('{"method": "eagle3", "num_speculative_tokens": 4, "model": "head"}', "must be an absolute path"),
])
def test_a_bad_speculative_config_parameter_is_named(text, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        BackendParameters.from_strings({"engine_dir": "/e", "speculative_config": text})


def test_a_real_triton_server_speculates_and_returns_the_greedy_completion(tiny_code_engine, tmp_path):
    from triton_server_util import Unavailable, find_install, layout_backend, start_server

    from kiln.runtime import LLM, SamplingParams

    try:
        install = find_install()
    except Unavailable as e:
        pytest.skip(str(e))
    prompts = ("def fibonacci(n):", "class Stack:")
    references = [o.text for o in LLM(tiny_code_engine).generate(
        list(prompts), SamplingParams(max_tokens=16, temperature=0))]
    backends, numpy_dir = layout_backend(install, tmp_path)
    repo = tmp_path / "models"
    write_repository(tiny_code_engine, repo, model_name="spec", python_path=[numpy_dir] if numpy_dir else [],
                     speculative_config={"method": "eagle3", "model": str(HEAD), "num_speculative_tokens": 4})
    server = start_server(install, repo, backends, tmp_path / "tritonserver.log", load=["spec"])
    try:
        server.wait_ready("spec", 180)
        for prompt, reference in zip(prompts, references):
            body = json.dumps({"text_input": prompt, "max_tokens": 16, "return_perf_metrics": True}).encode()
            request = urllib.request.Request(f"{server.http_base}/v2/models/spec/generate", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                out = json.loads(response.read())
            assert out["text_output"] == prompt + reference
            assert out["total_draft_tokens"] > 0 and 0 < out["total_accepted_draft_tokens"] <= out["total_draft_tokens"]
            assert out["acceptance_rate"] == pytest.approx(out["total_accepted_draft_tokens"] / out["total_draft_tokens"])
    finally:
        server.stop()
