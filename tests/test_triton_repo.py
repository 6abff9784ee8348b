"""`kiln triton-repo`: the written config.pbtxt read with Triton's own schema, and the written model.py run
the way Triton's Python backend runs it, against a stand-in of `triton_python_backend_utils`
(tests/triton_stub: no Triton server can run in CI)."""

import importlib.util
import json
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

import kiln
from kiln.cli import main
from kiln.runtime import LLM, AsyncLLM, SamplingParams
from kiln.serve.tritonserver.relay import Relay
from kiln.serve.tritonserver.repository import MODEL_SOURCE, site_directories
from kiln.serve.tritonserver.schema import DATATYPES, INPUT_SPECS, INPUTS, OUTPUT_SPECS, OUTPUTS

sys.path.insert(0, str(Path(__file__).parent / "triton_stub"))
import triton_python_backend_utils as pb  # noqa: E402

FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
MAX_TOKENS = 12
PROMPTS = ("def fibonacci(n):", "class Stack:", "import os\n", "def add(a, b):")


@pytest.fixture(scope="module")
def repo(tiny_code_engine, tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton") / "models"
    assert main(["triton-repo", "--engine", str(tiny_code_engine), "--output", str(repo)]) == 0
    return repo


@pytest.fixture(scope="module")
def references(tiny_code_engine):
    """Greedy outputs (with logprobs) of PROMPTS."""
    outputs = LLM(tiny_code_engine).generate(list(PROMPTS), SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                           logprobs=True))
    return dict(zip(PROMPTS, outputs))


def read_config(model_dir: Path) -> mc.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())


def import_model(model_dir: Path):
    """Imports model_dir/1/model.py as the Python backend does (a fresh module each time)."""
    spec = importlib.util.spec_from_file_location(f"kiln_triton_model_{time.monotonic_ns()}",
                                                  model_dir / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_model(model_dir: Path, parse_config=read_config, allow_numpy2=True, module=None):
    """Imports model_dir/1/model.py and initializes it with the args Triton's Python backend passes.
    `allow_numpy2`: the stand-in takes numpy 2 (Triton's stubs for numpy 1 do not: see the checks below)."""
    module = module or import_model(model_dir)
    model = module.TritonPythonModel()
    config = parse_config(model_dir)
    if allow_numpy2:
        config.parameters["allow_numpy2"].string_value = "true"
    model.initialize({
        "model_config": json_format.MessageToJson(config, preserving_proto_field_name=True),
        "model_instance_kind": "CPU", "model_instance_name": f"{config.name}_0_0", "model_instance_device_id": "0",
        "model_repository": str(model_dir), "model_version": "1", "model_name": config.name})
    return model


@pytest.fixture(scope="module")
def model(repo, tiny_code_engine):
    model = load_model(repo / tiny_code_engine.name)
    yield model
    model.finalize()


def make_request(prompts, max_tokens=MAX_TOKENS, outputs=None, **scalars):
    """One Triton request: a row per prompt. `outputs=None` asks for every output, as Triton does for a
    client that names none."""
    prompts = [prompts] if isinstance(prompts, str) else prompts
    tensors = [pb.Tensor("text_input", np.array([[p.encode()] for p in prompts], dtype=np.object_))]
    if max_tokens is not None:
        scalars["max_tokens"] = max_tokens
    for name, value in scalars.items():
        dtype = DATATYPES[INPUT_SPECS[name].datatype][1]
        tensors.append(pb.Tensor(name, np.array([[value]] * len(prompts), dtype=dtype)))
    return pb.InferenceRequest(tensors, list(OUTPUT_SPECS) if outputs is None else outputs)


def execute(model, *requests):
    assert model.execute(list(requests)) is None  # decoupled: the responses come through the senders
    for request in requests:
        request.release()  # Triton frees the input tensors once execute returns


def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def outputs_of(response) -> dict[str, np.ndarray]:
    assert not response.has_error(), response.error().message()
    return {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}


def texts(response) -> list[str]:
    return [row[0].decode() for row in outputs_of(response)["text_output"]]


def streamed(request) -> str:
    return "".join(texts(response)[0] for response in request.sender.responses)


def error_of(request) -> str:
    """The request's one response: an error, sent with the final flag."""
    assert request.sender.wait_final(30)
    [(_, response, flags)] = request.sender.sends
    assert flags == FINAL and response.has_error()
    return response.error().message()


# ---- config.pbtxt ------------------------------------------------------------------------------

def test_config_pbtxt_is_a_decoupled_python_model_with_the_schema_tensors(repo, tiny_code_engine, capsys):
    model_dir = repo / tiny_code_engine.name
    config = read_config(model_dir)
    assert config.name == tiny_code_engine.name and config.backend == "python" and not config.platform
    assert config.model_transaction_policy.decoupled
    assert config.max_batch_size == 16  # the engine's
    assert [(t.name, mc.DataType.Name(t.data_type), list(t.dims), t.optional) for t in config.input] == [
        (t.name, DATATYPES[t.datatype][0], list(t.dims), t.optional) for t in INPUTS]
    assert [(t.name, mc.DataType.Name(t.data_type), list(t.dims)) for t in config.output] == [
        (t.name, DATATYPES[t.datatype][0], list(t.dims)) for t in OUTPUTS]
    assert [(mc.ModelInstanceGroup.Kind.Name(g.kind), g.count) for g in config.instance_group] == [("KIND_CPU", 1)]
    assert {k: v.string_value for k, v in config.parameters.items()} == {
        "engine_dir": str(tiny_code_engine.resolve()), "batch_scheduler_policy": "max_utilization",
        "kv_cache_free_gpu_mem_fraction": "0.9", "enable_kv_cache_reuse": "true"}
    assert (model_dir / "1" / "model.py").read_text() == MODEL_SOURCE.read_text()
    assert sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*")) == [
        tiny_code_engine.name, f"{tiny_code_engine.name}/1", f"{tiny_code_engine.name}/1/kiln_env.json",
        f"{tiny_code_engine.name}/1/model.py", f"{tiny_code_engine.name}/config.pbtxt"]
    assert json.loads((model_dir / "1" / "kiln_env.json").read_text()) == {
        "python_path": site_directories(), "kiln_version": kiln.__version__,
        "kiln_dir": str(Path(kiln.__file__).resolve().parent)}


def test_cli_options_reach_the_config(tiny_code_engine, tmp_path, capsys):
    assert main(["triton-repo", "--engine", str(tiny_code_engine), "--output", str(tmp_path), "--model-name",
                 "code.v1-x", "--max-batch-size", "4", "--kv-cache-free-gpu-mem-fraction", "0.5",
                 "--enable-kv-cache-reuse", "false", "--batch-scheduler-policy", "guaranteed_no_evict"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "code.v1-x" / "config.pbtxt") in out and str(tmp_path / "code.v1-x" / "1" / "model.py") in out
    assert f"tritonserver --model-repository {tmp_path}" in out
    config = read_config(tmp_path / "code.v1-x")
    assert config.name == "code.v1-x" and config.max_batch_size == 4
    assert {k: v.string_value for k, v in config.parameters.items() if k != "engine_dir"} == {
        "batch_scheduler_policy": "guaranteed_no_evict", "kv_cache_free_gpu_mem_fraction": "0.5",
        "enable_kv_cache_reuse": "false"}


@pytest.mark.parametrize("argv, message", [
    (["--model-name", "a/b"], "model name 'a/b' is not usable"),
    (["--model-name", ".hidden"], "model name '.hidden' is not usable"),
    (["--max-batch-size", "17"], "--max-batch-size 17 must be between 1 and the engine's built limit 16"),
    (["--kv-cache-free-gpu-mem-fraction", "1.5"], "kv_cache_free_gpu_mem_fraction=1.5 must be a number in (0, 1]"),
])
def test_cli_refuses_bad_options(tiny_code_engine, tmp_path, capsys, argv, message):
    assert main(["triton-repo", "--engine", str(tiny_code_engine), "--output", str(tmp_path / "r"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln triton-repo: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_cli_refuses_a_directory_that_is_not_an_engine(tmp_path, capsys):
    (tmp_path / "not-an-engine").mkdir()
    assert main(["triton-repo", "--engine", str(tmp_path / "not-an-engine"), "--output", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln triton-repo: error: ") and "engine.json" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_cli_replaces_an_existing_model_only_with_force(tiny_code_engine, tmp_path, capsys):
    argv = ["triton-repo", "--engine", str(tiny_code_engine), "--output", str(tmp_path), "--model-name", "m"]
    assert main(argv) == 0
    (tmp_path / "m" / "2").mkdir()  # a stale version that --force must not leave behind
    assert main([*argv, "--max-batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err == f"kiln triton-repo: error: {tmp_path / 'm'} already exists; pass --force to replace it\n"
    assert read_config(tmp_path / "m").max_batch_size == 16
    assert main([*argv, "--max-batch-size", "2", "--force"]) == 0
    assert read_config(tmp_path / "m").max_batch_size == 2 and not (tmp_path / "m" / "2").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no staging directory left behind
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main([*argv[:-1], "other", "--force"]) == 2
    assert "is not a Triton model (it has no config.pbtxt)" in capsys.readouterr().err
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


# ---- model.py ----------------------------------------------------------------------------------

def test_streaming_and_whole_requests_run_together_and_a_new_one_joins(model, references):
    streaming = make_request(PROMPTS[0], stream=True)
    whole = make_request(PROMPTS[1])
    execute(model, streaming, whole)
    wait_for(lambda: streaming.sender.sends)
    joining = make_request(PROMPTS[2], stream=True, return_log_probs=True, outputs=[])
    execute(model, joining)
    for request in (streaming, whole, joining):
        assert request.sender.wait_final(60)

    # Streamed pieces never repeat the prompt and add up to the greedy completion; the last send is final.
    assert streamed(streaming) == references[PROMPTS[0]].text
    assert [flags for _, _, flags in streaming.sender.sends] == [0] * (len(streaming.sender.sends) - 1) + [FINAL]
    assert len(streaming.sender.sends) > 2
    # Not streamed: one final response with prompt + completion.
    [(_, response, flags)] = whole.sender.sends
    assert flags == FINAL and texts(response) == [PROMPTS[1] + references[PROMPTS[1]].text]
    assert set(outputs_of(response)) == {"text_output"}  # no log probs unless asked
    # The request that came later joined the running batch: its first piece came before the first one ended.
    assert joining.sender.sends[0][0] < streaming.sender.sends[-1][0]
    assert streamed(joining) == references[PROMPTS[2]].text
    logprobs = np.concatenate([outputs_of(r)["output_log_probs"][0, 0] for r in joining.sender.responses])
    np.testing.assert_allclose(logprobs, references[PROMPTS[2]].logprobs, atol=1e-4)
    cum = outputs_of(joining.sender.responses[-1])["cum_log_probs"]
    assert cum.shape == (1, 1) and cum.dtype == np.float32
    np.testing.assert_allclose(cum[0, 0], sum(references[PROMPTS[2]].logprobs), atol=1e-3)


def test_a_request_of_several_rows_gets_one_response_with_a_row_each(model, references):
    request = make_request([PROMPTS[3], PROMPTS[0]], exclude_input_in_output=True, return_log_probs=True)
    execute(model, request)
    assert request.sender.wait_final(60)
    [(_, response, flags)] = request.sender.sends
    out = outputs_of(response)
    assert flags == FINAL and texts(response) == [references[PROMPTS[3]].text, references[PROMPTS[0]].text]
    for row, prompt in enumerate((PROMPTS[3], PROMPTS[0])):
        expected = references[prompt].logprobs
        np.testing.assert_allclose(out["output_log_probs"][row, 0, :len(expected)], expected, atol=1e-4)
        np.testing.assert_allclose(out["cum_log_probs"][row, 0], sum(expected), atol=1e-3)


def test_invalid_requests_get_an_error_with_the_final_flag_and_others_complete(model, references):
    good = make_request(PROMPTS[3])
    no_max_tokens = make_request(PROMPTS[3], max_tokens=None)
    bad_top_p = make_request(PROMPTS[3], top_p=2.0)
    too_long = make_request(PROMPTS[3], max_tokens=5000)  # found on the engine thread: > max_seq_len
    streamed_rows = make_request([PROMPTS[3], PROMPTS[0]], stream=True)
    execute(model, no_max_tokens, good, bad_top_p, too_long, streamed_rows)

    assert error_of(no_max_tokens) == "missing required input 'max_tokens'"
    assert "top_p" in error_of(bad_top_p)
    assert "exceeds max_seq_len 1024" in error_of(too_long)
    assert "stream=true takes one prompt per request" in error_of(streamed_rows)
    assert good.sender.wait_final(60)
    assert texts(good.sender.responses[0]) == [PROMPTS[3] + references[PROMPTS[3]].text]


def test_guided_decoding_inputs_constrain_the_output_and_a_bad_guide_is_refused(model):
    regex = "[0-9]{3}-[a-z]{2,4}"
    guided = make_request(["id = ", "key = "], exclude_input_in_output=True, guided_decoding_guide_type=b"regex",
                          guided_decoding_guide=regex.encode())
    schema = make_request("data = ", exclude_input_in_output=True, guided_decoding_guide_type=b"json")
    # xgrammar refuses the regex (compiled row by row, in order): the whole batch gets one error naming row 0
    bad = make_request(["x = ", "y = "], guided_decoding_guide_type=b"regex", guided_decoding_guide=b"([a-z]")
    no_type = make_request("x = ", guided_decoding_guide=b"a+")
    execute(model, guided, schema, bad, no_type)
    assert error_of(bad).startswith("batch row 0: input 'guided_decoding_guide': guided_decoding.regex: invalid "
                                    "regex: Regex parsing error")
    assert error_of(no_type) == ("input 'guided_decoding_guide' needs input 'guided_decoding_guide_type' (one of "
                                 "json, json_schema, regex, ebnf_grammar) to say what it is")
    for request in (guided, schema):
        assert request.sender.wait_final(60)
    assert all(re.fullmatch(regex, text) for text in texts(guided.sender.responses[0]))
    assert isinstance(json.loads(texts(schema.sender.responses[0])[0]), dict)
    wait_for(lambda: model.llm.kv_cache_stats()["num_running"] == 0)
    stats = model.llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"] and stats["num_waiting"] == 0


def test_a_cancelled_request_is_aborted_and_its_kv_blocks_freed(model):
    request = make_request(PROMPTS[0], max_tokens=500, stream=True)
    execute(model, request)
    wait_for(lambda: len(request.sender.sends) >= 2)
    request.sender.cancel()
    assert request.sender.wait_final(30)
    assert request.sender.sends[-1][1:] == (None, FINAL)  # the final flag alone
    assert len(request.sender.sends) < 100
    wait_for(lambda: model.llm.kv_cache_stats()["num_running"] == 0)
    stats = model.llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == stats["num_waiting"] == 0


def test_finalize_ends_running_requests_and_stops_the_engine(repo, tiny_code_engine):
    model = load_model(repo / tiny_code_engine.name)
    request = make_request(PROMPTS[0], max_tokens=500, stream=True)
    execute(model, request)
    wait_for(lambda: request.sender.sends)
    model.finalize()
    assert not model.relay.is_running and not model.llm.is_running
    assert request.sender.finished and request.sender.sends[-1][1].error().message() == "the model is being unloaded"
    late = make_request(PROMPTS[0])
    execute(model, late)
    assert error_of(late) == "the kiln engine has stopped"


def test_a_model_that_is_not_decoupled_fails_to_load(repo, tiny_code_engine):
    def coupled(model_dir):
        config = read_config(model_dir)
        config.model_transaction_policy.decoupled = False
        return config

    with pytest.raises(pb.TritonModelException, match="decoupled: true"):
        load_model(repo / tiny_code_engine.name, coupled)


# ---- where model.py finds kiln, and what is known to break ---------------------------------------

def test_python_path_is_recorded_and_put_first_on_sys_path(tiny_code_engine, tmp_path, capsys, monkeypatch):
    extra = tmp_path / "numpy1"
    extra.mkdir()
    (extra / "kiln_marker_module.py").write_text("WHERE = 'numpy1'\n")
    assert main(["triton-repo", "--engine", str(tiny_code_engine), "--output", str(tmp_path / "r"),
                 "--model-name", "m", "--python-path", str(extra)]) == 0
    assert f"model.py adds to the Python backend's sys.path: {extra}, " in capsys.readouterr().out
    recorded = json.loads((tmp_path / "r" / "m" / "1" / "kiln_env.json").read_text())
    assert recorded["python_path"] == [str(extra), *site_directories()]
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in recorded["python_path"]])
    module = import_model(tmp_path / "r" / "m")  # site.addsitedir: the recorded directories come first
    assert sys.path[:len(recorded["python_path"])] == recorded["python_path"]
    assert module.RECORDED == recorded and importlib.import_module("kiln_marker_module").WHERE == "numpy1"
    sys.modules.pop("kiln_marker_module")

    assert main(["triton-repo", "--engine", str(tiny_code_engine), "--output", str(tmp_path / "r"),
                 "--model-name", "bare", "--no-site-path"]) == 0
    assert json.loads((tmp_path / "r" / "bare" / "1" / "kiln_env.json").read_text())["python_path"] == []
    assert main(["triton-repo", "--engine", str(tiny_code_engine), "--output", str(tmp_path / "r"),
                 "--model-name", "x", "--python-path", str(tmp_path / "missing")]) == 2
    assert "--python-path" in capsys.readouterr().err and not (tmp_path / "r" / "x").exists()


class _Numpy:
    def __init__(self, version: str) -> None:
        self.__version__ = version
        self.__file__ = "/somewhere/numpy/__init__.py"


def test_numpy_2_in_the_stub_fails_initialize_with_the_fix(repo, tiny_code_engine):
    model_dir = repo / tiny_code_engine.name
    module = import_model(model_dir)
    module.np = _Numpy("2.4.6")
    with pytest.raises(pb.TritonModelException, match=r'numpy 2.4.6 .*pip install "numpy<2"'):
        load_model(model_dir, allow_numpy2=False, module=module)
    module.np = _Numpy("1.26.4")
    model = load_model(model_dir, allow_numpy2=False, module=module)  # numpy 1 passes the check
    model.finalize()
    module.np = _Numpy("2.4.6")
    model = load_model(model_dir, allow_numpy2=True, module=module)  # the parameter allow_numpy2 overrides it
    model.finalize()


def test_a_kiln_other_than_the_repositorys_writer_fails_initialize(tiny_code_engine, tmp_path):
    assert main(["triton-repo", "--engine", str(tiny_code_engine), "--output", str(tmp_path), "--model-name", "m"]) == 0
    env_file = tmp_path / "m" / "1" / "kiln_env.json"
    env_file.write_text(json.dumps({**json.loads(env_file.read_text()), "kiln_version": "0.0.1"}))
    with pytest.raises(pb.TritonModelException, match=rf"written by kiln 0.0.1, but the Python backend imports kiln "
                                                      rf"{re.escape(kiln.__version__)} from "):
        load_model(tmp_path / "m")


def test_an_engine_this_kiln_cannot_read_fails_initialize_naming_the_kiln(tiny_code_engine, tmp_path):
    import shutil

    engine = tmp_path / "engine"
    shutil.copytree(tiny_code_engine, engine)
    assert main(["triton-repo", "--engine", str(engine), "--output", str(tmp_path / "r"), "--model-name", "m"]) == 0
    document = json.loads((engine / "engine.json").read_text())
    (engine / "engine.json").write_text(json.dumps({**document, "format_version": 999, "kiln_version": "9.0"}))
    with pytest.raises(pb.TritonModelException, match=rf"kiln {re.escape(kiln.__version__)} \(from .*\) cannot "
                                                      rf"load the engine: .*written by kiln 9.0"):
        load_model(tmp_path / "r" / "m")


# ---- batch scheduler policies (the engine thread alone, with a KV cache too small for two requests) ----

class RecordingSink:
    def __init__(self) -> None:
        self.updates = []  # (time.monotonic(), RequestOutput)
        self.done = threading.Event()

    def cancelled(self) -> bool:
        return False

    def update(self, row, output) -> None:
        self.updates.append((time.monotonic(), output))
        if output.finished:
            self.done.set()

    def reject(self, message) -> None:
        raise AssertionError(message)

    def abort(self, message) -> None:
        raise AssertionError(message)


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_batch_scheduler_policy(tiny_code_engine, references, policy):
    """The Triton parameter batch_scheduler_policy is the scheduler's capacity policy (RuntimeOptions
    capacity_scheduler_policy); the relay only relays. A KV cache of 3 blocks (48 token slots) holds one
    request of 10 prompt tokens + 16 at a time."""
    llm = AsyncLLM(tiny_code_engine, num_kv_blocks=3, capacity_scheduler_policy=policy)
    relay = Relay(llm)
    params = SamplingParams(max_tokens=16, temperature=0)  # 2 blocks each, 4 for both
    first, second = RecordingSink(), RecordingSink()
    relay.submit([llm.tokenize(PROMPTS[0])], [params], first)
    relay.submit([llm.tokenize(PROMPTS[0])], [params], second)
    try:
        assert first.done.wait(60) and second.done.wait(60)
    finally:
        relay.stop()
        llm.shutdown()
    assert not relay.is_running
    for sink in (first, second):
        assert sink.updates[-1][1].token_ids[:MAX_TOKENS] == references[PROMPTS[0]].token_ids
    first_finished = first.updates[-1][0]
    if policy == "guaranteed_no_evict":  # the second waits until the first's blocks are free: nobody is evicted
        assert llm.engine.num_preemptions == 0 and second.updates[0][0] > first_finished
    else:  # both start at once; when the blocks run out, the newer one is preempted and recomputed
        assert llm.engine.num_preemptions > 0 and second.updates[0][0] < first_finished


def test_a_row_that_fails_alone_ends_its_submission_with_the_error(tiny_code_engine, references):
    """A constraint that allows "def" and then nothing fails its row once running: that submission gets one
    `fail` naming the input (client_error), the relay goes on and a submission beside it is answered whole."""
    from kiln.runtime import GuidedDecoding

    class FailSink(RecordingSink):
        failed = None

        def fail(self, message, client_error) -> None:
            self.failed = (message, client_error)
            self.done.set()

    llm = AsyncLLM(tiny_code_engine)
    relay = Relay(llm)
    dead_end = SamplingParams(max_tokens=8, temperature=0,
                              guided_decoding=GuidedDecoding(grammar='root ::= "def" x\nx ::= x'))
    healthy, failing = RecordingSink(), FailSink()
    ids = llm.tokenize(PROMPTS[0])
    relay.submit([ids], [SamplingParams(max_tokens=MAX_TOKENS, temperature=0)], healthy)
    relay.submit([ids, ids], [SamplingParams(max_tokens=8, temperature=0), dead_end], failing)
    try:
        assert healthy.done.wait(60) and failing.done.wait(60)
        assert relay.is_running
    finally:
        relay.stop()
        llm.shutdown()
    message, client_error = failing.failed
    assert client_error and message.startswith("batch row 1: input 'guided_decoding_guide'") and \
        "allows no token" in message
    assert healthy.updates[-1][1].token_ids == references[PROMPTS[0]].token_ids
    engine = llm.engine
    stats = engine.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]
