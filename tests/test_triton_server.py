"""The repository of `kiln triton-repo` in a real Triton Inference Server (tests/triton_server_util.py: the
tritonserver bundled in the nvidia-pytriton wheel, CPU), driven over sockets by tritonclient and raw HTTP;
outputs equal kiln's in-process greedy outputs. Skipped, saying what to install, where nvidia-pytriton is not
installed."""

import json
import queue
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from triton_server_util import Unavailable, find_install, layout_backend, start_server

from kiln.runtime import LLM, SamplingParams
from kiln.serve.tritonserver.repository import write_repository

MODEL = "kiln-tiny-code"
MAX_TOKENS = 12
PROMPTS = ("def fibonacci(n):", "class Stack:", "import os\n", "def add(a, b):")
READY_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def install():
    try:
        return find_install()
    except Unavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def references(tiny_code_engine):
    """kiln's in-process greedy completions of PROMPTS."""
    outputs = LLM(tiny_code_engine).generate(list(PROMPTS), SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return {prompt: out.text for prompt, out in zip(PROMPTS, outputs)}


@pytest.fixture(scope="module")
def layout(install, tiny_code_engine, tmp_path_factory):
    """(repo, backends, numpy_dir): the backend laid out and the engine written as MODEL."""
    directory = tmp_path_factory.mktemp("triton-server")
    backends, numpy_dir = layout_backend(install, directory)
    repo = directory / "models"
    write_repository(tiny_code_engine, repo, model_name=MODEL, python_path=[numpy_dir] if numpy_dir else [])
    return repo, backends, numpy_dir


@pytest.fixture(scope="module")
def triton(install, layout, references):
    """The server, started from a folder holding a `kiln/` directory, as from the folder above a clone named
    kiln: the Python backend puts its working directory on sys.path, and model.py must still import the
    kiln that wrote the repository (issue 40)."""
    repo, backends, _ = layout
    started_in = repo.parent / "above-a-clone"
    (started_in / "kiln" / "kiln").mkdir(parents=True)
    server = start_server(install, repo, backends, repo.parent / "tritonserver.log", load=[MODEL], cwd=started_in)
    try:
        server.wait_ready(MODEL, READY_TIMEOUT_S)
        yield server
    finally:
        server.stop()


def post(server, path: str, body: dict, timeout: float = 60) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{server.http_base}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def sse_events(data: bytes) -> list[dict]:
    return [json.loads(line[len(b"data: "):]) for line in data.splitlines() if line.startswith(b"data: ")]


def test_the_model_is_ready_with_kilns_config(triton):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton.http_url)
    assert client.is_server_live() and client.is_model_ready(MODEL)
    config = client.get_model_config(MODEL)
    assert config["backend"] == "python" and config["model_transaction_policy"]["decoupled"] is True
    assert {i["name"] for i in client.get_model_metadata(MODEL)["inputs"]} >= {"text_input", "max_tokens", "stream"}


def test_the_model_imports_the_kiln_that_wrote_it_from_a_folder_holding_kiln(triton):
    """model.py says in the server's log which kiln it loaded: this one, not the `kiln/` folder where the
    server started."""
    import kiln

    kiln_dir = Path(kiln.__file__).resolve().parent
    assert f"kiln's Triton model: kiln {kiln.__version__} from {kiln_dir}\n" in triton.log()


def test_http_generate_returns_the_greedy_completion(triton, references):
    for prompt in PROMPTS:
        status, body = post(triton, f"/v2/models/{MODEL}/generate", {"text_input": prompt, "max_tokens": MAX_TOKENS})
        assert status == 200, body
        assert json.loads(body)["text_output"] == prompt + references[prompt]
    status, body = post(triton, f"/v2/models/{MODEL}/generate",
                        {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, "exclude_input_in_output": True})
    assert status == 200 and json.loads(body)["text_output"] == references[PROMPTS[0]]


def test_http_generate_stream_pieces_add_up_to_the_completion(triton, references):
    prompt = PROMPTS[1]
    status, body = post(triton, f"/v2/models/{MODEL}/generate_stream",
                        {"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True})
    assert status == 200, body
    events = sse_events(body)
    assert len(events) > 1 and all("error" not in e for e in events), events
    assert "".join(e.get("text_output", "") for e in events) == references[prompt]


def test_bad_inputs_get_an_error_and_the_server_goes_on(triton, references):
    status, body = post(triton, f"/v2/models/{MODEL}/generate", {"text_input": PROMPTS[0], "max_tokens": -3})
    assert status == 400 and "max_tokens" in json.loads(body)["error"]
    status, body = post(triton, f"/v2/models/{MODEL}/generate", {"max_tokens": 4})  # no text_input
    assert status == 400 and "text_input" in json.loads(body)["error"]
    status, body = post(triton, f"/v2/models/{MODEL}/generate",
                        {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, "stream": "yes"})
    assert status >= 400 and "error" in json.loads(body)  # Triton's own conversion refuses it (500 in 2.51)
    status, body = post(triton, f"/v2/models/{MODEL}/generate", {"text_input": PROMPTS[3], "max_tokens": MAX_TOKENS})
    assert status == 200 and json.loads(body)["text_output"] == PROMPTS[3] + references[PROMPTS[3]]


def _inputs(grpcclient, prompt: str, max_tokens: int, stream: bool):
    tensors = []
    for name, array, datatype in (("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
                                  ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
                                  ("stream", np.array([[stream]], dtype=bool), "BOOL")):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


class _Collector:
    """A gRPC stream's callback: per request id, its text pieces, errors and whether the final flag came."""

    def __init__(self) -> None:
        self.pieces: dict[str, list[str]] = {}
        self.errors: dict[str, str] = {}
        self.final: set[str] = set()
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()

    def __call__(self, result, error) -> None:
        with self.lock:
            if error is not None:
                request_id = getattr(error, "request_id", None) or ""
                self.errors[str(request_id)] = str(error)
                self.events.put(("error", str(error)))
                return
            response = result.get_response()
            request_id = response.id
            text = result.as_numpy("text_output")
            if text is not None:
                self.pieces.setdefault(request_id, []).extend(row.decode() for row in text.reshape(-1))
            if response.parameters["triton_final_response"].bool_param:
                self.final.add(request_id)
            self.events.put(("response", request_id))

    def wait(self, request_ids, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not set(request_ids) <= self.final | set(self.errors):
            assert time.monotonic() < deadline, f"timed out; finished {self.final}, errors {self.errors}"
            time.sleep(0.01)


def test_grpc_stream_with_several_requests_in_flight(triton, references):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    collector = _Collector()
    client.start_stream(collector)
    try:
        ids = []
        for i, prompt in enumerate(PROMPTS):  # all in flight at once: streamed and whole ones together
            request_id = f"r{i}"
            client.async_stream_infer(MODEL, _inputs(grpcclient, prompt, MAX_TOKENS, stream=i % 2 == 0),
                                      request_id=request_id, enable_empty_final_response=True)
            ids.append(request_id)
        collector.wait(ids)
    finally:
        client.stop_stream()
    assert not collector.errors
    for i, prompt in enumerate(PROMPTS):
        pieces = collector.pieces[f"r{i}"]
        if i % 2 == 0:
            assert "".join(pieces) == references[prompt]
        else:
            assert pieces == [prompt + references[prompt]]


def test_grpc_stream_bad_request_gets_an_error(triton):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    collector = _Collector()
    client.start_stream(collector)
    try:
        client.async_stream_infer(MODEL, _inputs(grpcclient, PROMPTS[0], -1, stream=True), request_id="bad")
        kind, message = collector.events.get(timeout=60)
    finally:
        client.stop_stream()
    assert kind == "error" and "max_tokens" in message


def test_a_cancelled_stream_is_aborted_and_the_server_goes_on(triton, references):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    collector = _Collector()
    client.start_stream(collector)
    # 1000 tokens keep the stub busy for seconds here; aborted, it goes idle at once.
    client.async_stream_infer(MODEL, _inputs(grpcclient, PROMPTS[0], 1000, stream=True), request_id="long")
    assert collector.events.get(timeout=60)[0] == "response"
    client.stop_stream(cancel_requests=True)
    assert "long" not in collector.final
    time.sleep(0.5)
    before = triton.stub_cpu_seconds()
    time.sleep(1.5)
    assert triton.stub_cpu_seconds() - before < 0.5  # the engine thread aborted the request
    status, body = post(triton, f"/v2/models/{MODEL}/generate", {"text_input": PROMPTS[2], "max_tokens": MAX_TOKENS})
    assert status == 200 and json.loads(body)["text_output"] == PROMPTS[2] + references[PROMPTS[2]]
    assert "could not be sent" not in triton.log()


def test_triton_metrics_count_the_requests(triton):
    with urllib.request.urlopen(triton.metrics_url, timeout=30) as response:
        text = response.read().decode()
    success = [line for line in text.splitlines()
               if line.startswith(f'nv_inference_request_success{{model="{MODEL}"')]
    assert success and float(success[0].rsplit(" ", 1)[1]) >= 1, text[:2000]


def test_a_stub_with_numpy_2_fails_to_load_with_the_fix_in_the_message(triton, layout, tiny_code_engine):
    import numpy
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    repo, _, numpy_dir = layout
    if numpy_dir is None:
        pytest.skip(f"this Python's numpy {numpy.__version__} is < 2: nothing to refuse")
    write_repository(tiny_code_engine, repo, model_name="numpy2")  # this venv's numpy 2 first
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    with pytest.raises(InferenceServerException, match=r'pip install "numpy<2"'):
        client.load_model("numpy2")
    assert client.is_model_ready(MODEL)


# ---- a server of its own per test: shutdown --------------------------------------------------------

@pytest.fixture
def fresh_triton(install, layout, triton):  # after the shared one started: the model is known to load
    repo, backends, _ = layout
    servers = []

    def start(exit_timeout_s: int):
        server = start_server(install, repo, backends, repo.parent / f"tritonserver-{len(servers)}.log",
                              load=[MODEL], exit_timeout_s=exit_timeout_s)
        servers.append(server)
        server.wait_ready(MODEL, READY_TIMEOUT_S)
        return server

    yield start
    for server in servers:
        server.stop()


def test_shutdown_lets_requests_in_flight_finish_then_unloads(fresh_triton, references):
    """SIGINT: Triton refuses new work and waits (up to exit_timeout) while requests run; kiln finishes them.
    An open gRPC stream keeps the model loaded until its client closes it (Triton's behaviour), so the client
    closes it once its responses are in, and the server then exits 0."""
    import tritonclient.grpc as grpcclient

    server = fresh_triton(exit_timeout_s=30)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    collector = _Collector()
    client.start_stream(collector)
    client.async_stream_infer(MODEL, _inputs(grpcclient, PROMPTS[1], 300, stream=True), request_id="long",
                              enable_empty_final_response=True)
    assert collector.events.get(timeout=60) == ("response", "long")
    client.async_stream_infer(MODEL, _inputs(grpcclient, PROMPTS[2], MAX_TOKENS, stream=True), request_id="short",
                              enable_empty_final_response=True)
    # The signal goes once the short request is running too (its first piece is in): sent right after the
    # request, it could reach the server first, which then refuses the request as for an unloading model.
    while True:
        event = collector.events.get(timeout=60)
        assert event[0] == "response", event
        if event[1] == "short":
            break
    started = time.monotonic()
    server.signal(signal.SIGINT)
    collector.wait(["short", "long"], timeout=60)
    assert not collector.errors, collector.errors
    assert "".join(collector.pieces["short"]) == references[PROMPTS[2]]
    assert "".join(collector.pieces["long"]).startswith(references[PROMPTS[1]])
    client.stop_stream()
    assert server.process.wait(60) == 0
    server.stopped = True
    assert time.monotonic() - started < 30
    assert "successfully unloaded" in server.log()
