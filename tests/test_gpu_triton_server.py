"""The generated repository in a real Triton Inference Server on a GPU: the engine built for CUDA, its
instance group KIND_GPU, Triton's Python backend loading it on the instance's device; HTTP generate answers
as the in-process engine does. The server is the nvidia-pytriton wheel's (tests/triton_server_util.py), which
runs on GPU machines too; skipped, saying what is missing, where it cannot run."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_kind_gpu_model_serves_greedy_completions_in_a_real_triton(tmp_path):
    from model_factory import make_checkpoint
    from test_triton_server import post
    from triton_server_util import Unavailable, find_install, layout_backend, start_server

    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig
    from kiln.runtime import LLM, SamplingParams
    from kiln.serve.tritonserver.repository import write_repository

    try:
        install = find_install()
    except Unavailable as e:
        pytest.skip(str(e))
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(device="cuda", dtype="bfloat16",
                                                                         max_batch_size=4, max_seq_len=128),
                          progress=False)
    prompts = ["the cat", "a b c"]
    want = [o.text for o in LLM(engine).generate(prompts, SamplingParams(max_tokens=8, temperature=0))]
    backends, numpy_dir = layout_backend(install, tmp_path)
    repo = tmp_path / "models"
    write_repository(engine, repo, model_name="tiny", python_path=[numpy_dir] if numpy_dir else [])
    assert "KIND_GPU" in (repo / "tiny" / "config.pbtxt").read_text()
    server = start_server(install, repo, backends, tmp_path / "tritonserver.log", load=["tiny"])
    try:
        server.wait_ready("tiny", 180)
        for prompt, text in zip(prompts, want):
            status, body = post(server, "/v2/models/tiny/generate",
                                {"text_input": prompt, "max_tokens": 8, "exclude_input_in_output": True})
            assert status == 200, body
            assert json.loads(body)["text_output"] == text
    finally:
        server.stop()
