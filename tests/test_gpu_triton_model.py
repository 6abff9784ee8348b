"""The generated Triton model on a GPU: a KIND_GPU instance (Triton's instance kind and device id, as its
Python backend passes them to initialize) runs the engine on that device and answers as the in-process
engine does. Runs the model.py of `kiln triton-repo` under the stand-in for triton_python_backend_utils
(tests/triton_stub); the real server's CPU tests (test_triton_server.py) run the same model.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_kind_gpu_instance_runs_the_engine_on_its_device(tmp_path):
    pytest.importorskip("tritonclient.grpc", reason="reads config.pbtxt with Triton's protobuf stubs")
    from google.protobuf import json_format
    from model_factory import make_checkpoint
    from test_triton_repo import FINAL, execute, import_model, make_request, read_config, texts

    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig
    from kiln.cli import main
    from kiln.runtime import LLM, SamplingParams

    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(device="cuda", dtype="bfloat16",
                                                                         max_batch_size=4, max_seq_len=128),
                          progress=False)
    repo = tmp_path / "models"
    assert main(["triton-repo", "--engine", str(engine), "--output", str(repo)]) == 0
    model_dir = repo / engine.name
    config = read_config(model_dir)
    assert [group.kind for group in config.instance_group] == [config.instance_group[0].KIND_GPU]
    config.parameters["allow_numpy2"].string_value = "true"  # the stand-in takes numpy 2
    model = import_model(model_dir).TritonPythonModel()
    device = torch.cuda.device_count() - 1  # the instance's device: the last GPU, not the default one
    model.initialize({
        "model_config": json_format.MessageToJson(config, preserving_proto_field_name=True),
        "model_instance_kind": "GPU", "model_instance_name": f"{config.name}_0_{device}",
        "model_instance_device_id": str(device), "model_repository": str(model_dir), "model_version": "1",
        "model_name": config.name})
    try:
        assert model.llm.engine.runtime.device == torch.device("cuda", device)
        prompts = ["the cat", "a b c"]
        request = make_request(prompts, max_tokens=8, exclude_input_in_output=True)
        execute(model, request)
        assert request.sender.wait_final(120)
        [(_, response, flags)] = request.sender.sends
        assert flags == FINAL
        want = LLM(engine, device=f"cuda:{device}").generate(
            prompts, SamplingParams(max_tokens=8, temperature=0))
        assert texts(response) == [o.text for o in want]
    finally:
        model.finalize()
