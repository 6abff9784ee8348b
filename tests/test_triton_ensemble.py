"""`kiln triton-repo --layout ensemble`: TensorRT-LLM backend's five models (kiln/serve/tritonserver/layout.py).
The written config.pbtxt files read with Triton's own schema (CPU), then the real Triton server
(tests/triton_server_util.py; skipped where nvidia-pytriton is missing) serving the layout beside the
single-model layout: `ensemble` and `tensorrt_llm_bls` answer through tritonclient with the single model's text."""

import json
import queue

import numpy as np
import pytest
from google.protobuf import text_format
from triton_server_util import Unavailable, find_install, layout_backend, start_server
from tritonclient.grpc import model_config_pb2 as mc

from kiln.cli import main
from kiln.serve.tritonserver.layout import BLS, ENSEMBLE, MODEL_NAMES, STEP_WIRING, TENSORRT_LLM, routes
from kiln.serve.tritonserver.repository import write_repository
from kiln.serve.tritonserver.schema import INPUT_SPECS

SINGLE = "kiln-tiny-code"
MAX_TOKENS = 12
PROMPTS = ("def fibonacci(n):", "class Stack:")
READY_TIMEOUT_S = 240


def read_config(repo, name) -> mc.ModelConfig:
    return text_format.Parse((repo / name / "config.pbtxt").read_text(), mc.ModelConfig())


@pytest.fixture(scope="module")
def written(tiny_code_engine, tmp_path_factory):
    repo = tmp_path_factory.mktemp("ensemble") / "models"
    assert main(["triton-repo", "--engine", str(tiny_code_engine), "--output", str(repo), "--layout", "ensemble"]) == 0
    return repo


def test_the_layout_has_tensorrt_llms_five_models(written):
    assert sorted(p.name for p in written.iterdir()) == sorted(MODEL_NAMES)
    for name in MODEL_NAMES:
        config = read_config(written, name)
        assert config.name == name
        if name == ENSEMBLE:
            assert config.platform == "ensemble" and not (written / name / "1" / "model.py").exists()
        else:
            assert config.backend == "python" and config.parameters["kiln_model"].string_value == name
            assert {p.name for p in (written / name / "1").iterdir()} == {"model.py", "kiln_model.py", "kiln_env.json"}
    assert read_config(written, TENSORRT_LLM).model_transaction_policy.decoupled
    assert read_config(written, BLS).model_transaction_policy.decoupled


def test_ensemble_and_bls_take_the_same_client_tensors(written):
    ensemble, bls = read_config(written, ENSEMBLE), read_config(written, BLS)
    assert list(ensemble.input) == list(bls.input) and list(ensemble.output) == list(bls.output)
    names = {i.name for i in ensemble.input}
    assert {"text_input", "max_tokens", "bad_words", "stop_words", "stream", "end_id", "top_k"} <= names
    assert [o.name for o in ensemble.output][0] == "text_output"
    trt = {i.name: i for i in read_config(written, TENSORRT_LLM).input}
    assert {"input_ids", "input_lengths", "request_output_len", "stop_words_list", "runtime_top_k",
            "streaming"} <= set(trt)
    assert mc.DataType.Name(trt["input_ids"].data_type) == "TYPE_INT32"


def test_the_ensembles_steps_wire_every_tensor(written):
    steps = {s.model_name: s for s in read_config(written, ENSEMBLE).ensemble_scheduling.step}
    assert list(steps) == ["preprocessing", "tensorrt_llm", "postprocessing"]
    for route in routes():
        assert steps[route.model].input_map[route.target] == route.spec.name
    for source, output, target, name in STEP_WIRING:
        assert steps[source].output_map[output] == steps[target].input_map[name] == "_" + output
    assert steps["postprocessing"].output_map["OUTPUT"] == "text_output"
    required = {i.name for i in read_config(written, TENSORRT_LLM).input if not i.optional}
    assert required <= set(steps["tensorrt_llm"].input_map)
    # every model input the steps feed exists in that model's config
    for model, step in steps.items():
        assert set(step.input_map) <= {i.name for i in read_config(written, model).input}
        assert set(step.output_map) <= {o.name for o in read_config(written, model).output}


def test_layout_flags_are_checked(tiny_code_engine, tmp_path, capsys):
    with pytest.raises(ValueError, match="--model-name does not apply to --layout ensemble"):
        write_repository(tiny_code_engine, tmp_path, model_name="x", layout="ensemble")
    with pytest.raises(ValueError, match="--layout 'pipeline' must be one of single, ensemble"):
        write_repository(tiny_code_engine, tmp_path, layout="pipeline")
    write_repository(tiny_code_engine, tmp_path, layout="ensemble")
    with pytest.raises(ValueError, match="preprocessing already exists; pass --force"):
        write_repository(tiny_code_engine, tmp_path, layout="ensemble")
    assert write_repository(tiny_code_engine, tmp_path, layout="ensemble", force=True).model_dir.name == TENSORRT_LLM


def test_every_single_model_input_reaches_tensorrt_llm(written):
    """An input added to schema.INPUTS reaches the engine through both paths (one table)."""
    trt = {i.name for i in read_config(written, TENSORRT_LLM).input}
    for route in routes():
        assert route.spec.name in INPUT_SPECS
        if route.model == TENSORRT_LLM:
            assert route.target in trt


@pytest.fixture(scope="module")
def tokenizer(tiny_code_engine):
    from kiln.serve.tritonserver.text_steps import load_tokenizer

    return load_tokenizer(str(tiny_code_engine))[0]


def test_word_lists_round_trip_in_tensorrt_llms_layout(tokenizer):
    from kiln.serve.tritonserver.text_steps import word_list, words_of

    words = word_list(tokenizer, ["return", "", " while True"])
    ids = tokenizer.encode("return", add_special_tokens=False) + tokenizer.encode(" while True",
                                                                                  add_special_tokens=False)
    assert words.shape == (2, len(ids)) and words[0].tolist() == ids
    assert words[1].tolist()[:2] == [len(tokenizer.encode("return", add_special_tokens=False)), len(ids)]
    assert words_of(tokenizer, words, "stop_words_list") == ["return", " while True"]
    assert word_list(tokenizer, []).tolist() == [[0], [-1]] and words_of(tokenizer, word_list(tokenizer, []), "x") == []
    from kiln.serve.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="input .bad_words_list.: offsets .3. must increase"):
        words_of(tokenizer, np.array([[5, 6], [3, -1]]), "bad_words_list")


def test_token_rows_take_the_single_models_inputs(tokenizer):
    from kiln.serve.errors import InvalidRequest
    from kiln.serve.tritonserver.token_model import parse_token_rows

    stops = np.array([[[7, 8], [2, -1]]], dtype=np.int32)
    ((ids, row),) = parse_token_rows(tokenizer, {
        "input_ids": np.array([[0, 322, 287, 9]], dtype=np.int32), "input_lengths": np.array([[3]], np.int32),
        "request_output_len": np.array([[5]], np.int32), "runtime_top_k": np.array([[4]], np.int32),
        "end_id": np.array([[-1]], np.int32), "stop_words_list": stops, "streaming": np.array([[True]])})
    assert ids == [0, 322, 287] and row.stream and row.params.max_tokens == 5 and row.params.top_k == 4
    assert row.params.stop == (tokenizer.decode([7, 8]),) and not row.params.ignore_eos
    with pytest.raises(InvalidRequest, match="input 'input_lengths' is 9"):
        parse_token_rows(tokenizer, {"input_ids": np.array([[1, 2]], np.int32),
                                     "input_lengths": np.array([[9]], np.int32),
                                     "request_output_len": np.array([[5]], np.int32)})
    with pytest.raises(InvalidRequest, match="runtime_top_k|top_k"):
        parse_token_rows(tokenizer, {"input_ids": np.array([[1, 2]], np.int32),
                                     "input_lengths": np.array([[2]], np.int32),
                                     "request_output_len": np.array([[5]], np.int32),
                                     "runtime_top_k": np.array([[-3]], np.int32)})


def test_the_relay_stops_asking_about_cancellation_once_answered():
    """Triton may free a response sender once its final response is out; asking it then crashes the server."""
    from kiln.serve.tritonserver.relay import _Answered

    class Sink:
        asked = 0

        def cancelled(self):
            self.asked += 1
            return False

        def update(self, row, output):
            pass

    class Output:
        def __init__(self, finished):
            self.finished = finished

    sink = Sink()
    answered = _Answered(sink, 2)
    answered.update(0, Output(True))
    assert not answered.cancelled() and sink.asked == 1
    answered.update(1, Output(True))
    assert not answered.cancelled() and sink.asked == 1


# ---- the real Triton server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def triton(tiny_code_engine, tmp_path_factory):
    try:
        install = find_install()
    except Unavailable as e:
        pytest.skip(str(e))
    directory = tmp_path_factory.mktemp("triton-ensemble")
    backends, numpy_dir = layout_backend(install, directory)
    repo = directory / "models"
    python_path = [numpy_dir] if numpy_dir else []
    write_repository(tiny_code_engine, repo, model_name=SINGLE, python_path=python_path)
    write_repository(tiny_code_engine, repo, python_path=python_path, layout="ensemble")
    server = start_server(install, repo, backends, directory / "tritonserver.log", load=[SINGLE, *MODEL_NAMES])
    try:
        for name in (SINGLE, *MODEL_NAMES):
            server.wait_ready(name, READY_TIMEOUT_S)
        yield server
    finally:
        server.stop()


def _grpc_texts(triton, model: str, prompt: str, stream: bool) -> list[str]:
    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    inputs = []
    for name, array in (("text_input", np.array([[prompt.encode()]], dtype=np.object_)),
                        ("max_tokens", np.array([[MAX_TOKENS]], dtype=np.int32)),
                        ("bad_words", np.array([[b""]], dtype=np.object_)),
                        ("stop_words", np.array([[b""]], dtype=np.object_)),
                        ("stream", np.array([[stream]], dtype=np.bool_))):
        tensor = grpcclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else
                                       {"int32": "INT32", "bool": "BOOL"}[array.dtype.name])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        texts = []
        while True:
            result, error = answers.get(timeout=120)
            assert error is None, error
            out = result.as_numpy("text_output")
            if out is not None and out.size:
                texts.append(out.reshape(-1)[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                return texts
    finally:
        client.stop_stream()
        client.close()


def _generate(triton, model: str, prompt: str) -> str:
    import urllib.request

    body = json.dumps({"text_input": prompt, "max_tokens": MAX_TOKENS, "bad_words": "", "stop_words": ""}).encode()
    request = urllib.request.Request(f"{triton.http_base}/v2/models/{model}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        text = json.loads(response.read())["text_output"]
    return text[0] if isinstance(text, list) else text


def test_ensemble_and_bls_answer_with_the_single_models_text(triton):
    for prompt in PROMPTS:
        single = _generate(triton, SINGLE, prompt)
        assert single.startswith(prompt) and len(single) > len(prompt)
        assert _generate(triton, ENSEMBLE, prompt) == single
        assert _generate(triton, BLS, prompt) == single
        assert "".join(_grpc_texts(triton, ENSEMBLE, prompt, stream=False)) == single
        assert "".join(_grpc_texts(triton, BLS, prompt, stream=False)) == single


def test_streaming_through_both_paths_adds_up_to_the_completion(triton):
    prompt = PROMPTS[0]
    completion = _generate(triton, SINGLE, prompt)[len(prompt):]
    pieces = _grpc_texts(triton, BLS, prompt, stream=True)
    assert len(pieces) > 1 and "".join(pieces) == completion
    assert "".join(_grpc_texts(triton, ENSEMBLE, prompt, stream=True)) == completion


def _grpc_batch(triton, model: str) -> dict:
    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    inputs = []
    for name, array, datatype in (("text_input", np.array([[p.encode()] for p in PROMPTS], np.object_), "BYTES"),
                                  ("max_tokens", np.array([[6], [9]], np.int32), "INT32"),
                                  ("return_log_probs", np.array([[True], [True]]), "BOOL")):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(model, inputs)
        result, error = answers.get(timeout=120)
        assert error is None, error
        return {name: result.as_numpy(name) for name in ("text_output", "cum_log_probs", "output_log_probs")}
    finally:
        client.stop_stream()
        client.close()


def test_a_batch_with_log_probs_equals_the_single_models(triton):
    single = _grpc_batch(triton, SINGLE)
    assert single["text_output"].shape[0] == 2
    for model in (ENSEMBLE, BLS):
        out = _grpc_batch(triton, model)
        assert out["text_output"].tolist() == single["text_output"].tolist()
        np.testing.assert_allclose(out["cum_log_probs"], single["cum_log_probs"], rtol=1e-6)
        np.testing.assert_allclose(out["output_log_probs"], single["output_log_probs"], rtol=1e-6)
