"""Triton / KServe v2 over HTTP, driven by the real `tritonclient.http` client and by raw HTTP."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import struct
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from serve_util import MODEL_NAME
from tritonclient.utils import InferenceServerException

import kiln
from kiln.runtime import LLM, SamplingParams
from kiln.serve.tritonserver.logits_outputs import EXTRA_OUTPUTS

PROMPT = "def add(a, b):"
PROMPT2 = "class Stack:"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def greedy(tiny_code_engine):
    """prompt -> (greedy completion, its per-token logprobs), in process."""
    llm = LLM(tiny_code_engine)
    cache = {}

    def run(prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[str, list[float]]:
        if (prompt, max_tokens) not in cache:
            out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=True))[0]
            cache[prompt, max_tokens] = out.text, out.logprobs
        return cache[prompt, max_tokens]

    return run


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(url=server.http_url)
    yield c
    c.close()


def post(server, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.http_base + path, data=data, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(server, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(server.http_base + path, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream_events(server, path: str, body: dict) -> list[dict]:
    request = urllib.request.Request(server.http_base + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = response.read().decode()
    chunks = [c for c in raw.split("\n\n") if c]
    assert all(c.startswith("data: ") for c in chunks), raw
    return [json.loads(c[len("data: "):]) for c in chunks]


def inputs(prompts: list[str], max_tokens: int = MAX_TOKENS, binary: bool = True, **flags: bool):
    text = httpclient.InferInput("text_input", [len(prompts), 1], "BYTES")
    text.set_data_from_numpy(np.array([[p.encode()] for p in prompts], dtype=object), binary_data=binary)
    tokens = httpclient.InferInput("max_tokens", [len(prompts), 1], "INT32")
    tokens.set_data_from_numpy(np.full((len(prompts), 1), max_tokens, dtype=np.int32), binary_data=binary)
    result = [text, tokens]
    for name, value in flags.items():
        flag = httpclient.InferInput(name, [len(prompts), 1], "BOOL")
        flag.set_data_from_numpy(np.full((len(prompts), 1), value, dtype=bool), binary_data=binary)
        result.append(flag)
    return result


def aborted_requests(server) -> float:
    metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return float(re.search(r'^kiln_requests_total\{outcome="abort"\} (\S+)$', metrics, re.M).group(1))


def assert_blocks_free(server, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.kv_cache_stats()
        if stats["free_blocks"] == stats["total_blocks"]:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


# ---- health and metadata ---------------------------------------------------------------------------
def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL_NAME) and client.is_model_ready(MODEL_NAME, "1")
    assert not client.is_model_ready("other-model") and not client.is_model_ready(MODEL_NAME, "2")
    meta = client.get_server_metadata()
    assert meta["name"] == "kiln" and meta["version"] == kiln.__version__
    assert set(meta["extensions"]) == {"binary_tensor_data", "model_configuration", "generate", "parameters"}
    model = client.get_model_metadata(MODEL_NAME)
    assert model["name"] == MODEL_NAME and model["versions"] == ["1"]
    assert {"name": "text_input", "datatype": "BYTES", "shape": [-1, 1]} in model["inputs"]
    assert [t["name"] for t in model["outputs"]] == ["text_output", "output_log_probs", "cum_log_probs",
                                                     "output_ids", "sequence_length", *EXTRA_OUTPUTS]
    config = client.get_model_config(MODEL_NAME)
    assert config["name"] == MODEL_NAME and config["max_batch_size"] == 16
    assert config["model_transaction_policy"]["decoupled"] is True
    assert {i["name"]: i["data_type"] for i in config["input"]}["max_tokens"] == "TYPE_INT32"


def test_versioned_paths_and_unknown_models(server):
    assert get(server, f"/v2/models/{MODEL_NAME}/versions/1")[1]["name"] == MODEL_NAME
    assert get(server, f"/v2/models/{MODEL_NAME}/versions/1/config")[0] == 200
    status, body = get(server, f"/v2/models/{MODEL_NAME}/versions/7")
    assert status == 404 and "version '7'" in body["error"]
    status, body = get(server, "/v2/models/gpt-9")
    assert status == 404 and "gpt-9" in body["error"]
    status, body = post(server, "/v2/models/gpt-9/infer", {"inputs": []})
    assert status == 404 and "gpt-9" in body["error"]
    status, body = post(server, f"/v2/models/{MODEL_NAME}/versions/2/generate", {"text_input": "x"})
    assert status == 404 and "version '2'" in body["error"]


# ---- infer through tritonclient --------------------------------------------------------------------
@pytest.mark.parametrize("binary_inputs", [True, False])
@pytest.mark.parametrize("binary_output", [None, True, False])
def test_infer_matches_greedy(client, greedy, binary_inputs, binary_output):
    outputs = None if binary_output is None else [httpclient.InferRequestedOutput("text_output",
                                                                                   binary_data=binary_output)]
    result = client.infer(MODEL_NAME, inputs([PROMPT], binary=binary_inputs), outputs=outputs)
    text = result.as_numpy("text_output")
    assert text.shape == (1, 1)
    value = text[0, 0]
    # binary BYTES come back as bytes, JSON ones as str (as from Triton)
    assert value == (PROMPT + greedy(PROMPT)[0] if binary_output is False else (PROMPT + greedy(PROMPT)[0]).encode())
    response = result.get_response()
    assert response["model_name"] == MODEL_NAME and response["model_version"] == "1"


def test_infer_exclude_input_and_request_id(client, greedy):
    result = client.infer(MODEL_NAME, inputs([PROMPT], exclude_input_in_output=True), request_id="my-id")
    assert result.as_numpy("text_output")[0, 0] == greedy(PROMPT)[0].encode()
    assert result.get_response()["id"] == "my-id"


def test_infer_batch_of_two(client, greedy, server):
    result = client.infer(MODEL_NAME, inputs([PROMPT, PROMPT2], exclude_input_in_output=True))
    assert result.as_numpy("text_output").ravel().tolist() == [greedy(PROMPT)[0].encode(),
                                                               greedy(PROMPT2)[0].encode()]


@pytest.mark.parametrize("binary", [True, False])
def test_infer_log_probs(client, greedy, binary):
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary)
               for n in ("text_output", "output_log_probs", "cum_log_probs")]
    result = client.infer(MODEL_NAME, inputs([PROMPT], return_log_probs=True), outputs=outputs)
    logprobs = result.as_numpy("output_log_probs")
    _, expected = greedy(PROMPT)
    assert logprobs.shape == (1, 1, len(expected)) and logprobs.dtype == np.float32  # [batch, beam, len]
    np.testing.assert_allclose(logprobs[0, 0], expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(result.as_numpy("cum_log_probs")[0, 0], logprobs.sum(), rtol=1e-5, atol=1e-4)


def test_infer_compressed_both_ways(server, greedy):
    client = httpclient.InferenceServerClient(url=server.http_url)
    try:
        result = client.infer(MODEL_NAME, inputs([PROMPT]), request_compression_algorithm="gzip",
                              response_compression_algorithm="deflate")
        assert result.as_numpy("text_output")[0, 0] == (PROMPT + greedy(PROMPT)[0]).encode()
    finally:
        client.close()


def test_infer_errors_through_tritonclient(client):
    # Log-prob outputs without return_log_probs come back empty, as TensorRT-LLM's backend answers them.
    result = client.infer(MODEL_NAME, inputs([PROMPT]), outputs=[httpclient.InferRequestedOutput("output_log_probs")])
    assert result.as_numpy("output_log_probs").size == 0
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.infer("nope", inputs([PROMPT]))


# ---- infer: raw requests and bad input -------------------------------------------------------------
def infer_body(*tensors: dict, max_tokens: int | list = 4, **extra) -> dict:
    return {"inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [PROMPT]},
                       {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [max_tokens]}, *tensors],
            **extra}


def test_infer_json_nested_data(server, greedy):
    body = {"inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [[PROMPT]]},
                       {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [[MAX_TOKENS]]}]}
    status, response = post(server, f"/v2/models/{MODEL_NAME}/infer", body)
    assert status == 200, response
    assert response["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": [1, 1],
                                    "data": [PROMPT + greedy(PROMPT)[0]]}]
    assert "id" not in response


def binary_request(prompt: bytes, max_tokens: int, *, claimed: int | None = None, extra: bytes = b""):
    """A hand-made binary-data infer request -> (body, headers)."""
    text = struct.pack("<I", len(prompt)) + prompt
    header = json.dumps({"inputs": [
        {"name": "text_input", "shape": [1, 1], "datatype": "BYTES",
         "parameters": {"binary_data_size": len(text) if claimed is None else claimed}},
        {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "parameters": {"binary_data_size": 4}},
    ]}).encode()
    body = header + text + struct.pack("<i", max_tokens) + extra
    return body, {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}


MAX_SEQ_LEN = 1024
DEEP = b"[" * 100_000 + b"]" * 100_000
BAD_INFER = [
    (b"{not json", "not valid JSON"),
    (DEEP, "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    ({"id": "x"}, "'inputs'"),
    ({"inputs": "text"}, "'inputs'"),
    ({"inputs": [{"shape": [1]}]}, "inputs[0]"),
    (infer_body({"name": "prompt", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}), "unknown input 'prompt'"),
    (infer_body({"name": "temperature", "shape": [1, 1], "datatype": "FP64", "data": [0.5]}),
     "'temperature' has datatype FP64"),
    (infer_body({"name": "top_k", "shape": [1, 2], "datatype": "INT32", "data": [1]}), "'top_k' has shape [1, 2]"),
    (infer_body({"name": "top_k", "shape": [1, 1], "datatype": "INT32", "data": ["3"]}), "'top_k' is INT32"),
    (infer_body({"name": "top_k", "shape": [1, 1], "datatype": "INT32", "data": [2**40]}), "'top_k' is INT32"),
    (infer_body({"name": "top_k", "shape": "1", "datatype": "INT32", "data": [1]}), "'top_k' needs 'shape'"),
    (infer_body({"name": "top_k", "shape": [1, 1], "datatype": "INT32"}), "'top_k' has no 'data'"),
    (infer_body({"name": "top_p", "shape": [1, 1], "datatype": "FP32", "data": [2.0]}), "top_p"),
    (infer_body({"name": "stream", "shape": [1, 1], "datatype": "BOOL", "data": [1]}), "'stream' is BOOL"),
    (infer_body({"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [5]}), "'max_tokens' is given twice"),
    (infer_body({"name": "top_k", "shape": [2, 1], "datatype": "INT32", "data": [1, 1]}), "'top_k' has batch size 2"),
    ({"inputs": [{"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [4]}]}, "'text_input'"),
    (infer_body(outputs=[{"name": "logits"}]), "unknown output 'logits'"),
    (infer_body(outputs=[{"name": "text_output", "parameters": {"binary_data": "yes"}}]), "binary_data"),
    (infer_body(parameters=[1]), "parameters"),
    (infer_body(max_tokens=MAX_SEQ_LEN), "max_tokens"),
    ({"inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [""]},
                 {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [4]}]}, "prompt is empty"),
    ({"inputs": [{"name": "text_input", "shape": [17, 1], "datatype": "BYTES", "data": ["x"] * 17},
                 {"name": "max_tokens", "shape": [17, 1], "datatype": "INT32", "data": [1] * 17}]}, "max_batch_size"),
    (binary_request(b"\xff\xfe", 4), "not valid UTF-8"),
    (binary_request(PROMPT.encode(), 4, claimed=100), "binary_data_size 100"),
    (binary_request(PROMPT.encode(), 4, extra=b"junk"), "4 bytes of binary data"),
    ((b'{"inputs": []}', {"Inference-Header-Content-Length": "99"}), "Inference-Header-Content-Length"),
]


@pytest.mark.parametrize("body, message", BAD_INFER, ids=[m for _, m in BAD_INFER])
def test_infer_rejects_bad_requests(server, body, message):
    headers = {}
    if isinstance(body, tuple):
        body, headers = body
    status, response = post(server, f"/v2/models/{MODEL_NAME}/infer", body, headers)
    assert status == 400, response
    assert message in response["error"]


def test_infer_deeply_nested_data(server):
    deep = [4]
    for _ in range(600):
        deep = [deep]
    status, response = post(server, f"/v2/models/{MODEL_NAME}/infer", infer_body(max_tokens=deep))
    assert status == 200 and response["outputs"][0]["data"][0].startswith(PROMPT)


def test_infer_binary_by_hand(server, greedy):
    body, headers = binary_request(PROMPT.encode(), MAX_TOKENS)
    status, response = post(server, f"/v2/models/{MODEL_NAME}/infer", body, headers)
    assert status == 200 and response["outputs"][0]["data"] == [PROMPT + greedy(PROMPT)[0]]


def test_infer_batch_error_names_the_row(server):
    body = {"inputs": [{"name": "text_input", "shape": [2, 1], "datatype": "BYTES", "data": [PROMPT, "x " * 900]},
                       {"name": "max_tokens", "shape": [2, 1], "datatype": "INT32", "data": [400, 400]}]}
    status, response = post(server, f"/v2/models/{MODEL_NAME}/infer", body)
    assert status == 400 and "batch row 1" in response["error"] and "max_tokens" in response["error"]
    assert_blocks_free(server)


# ---- generate extension ----------------------------------------------------------------------------
def test_generate(server, greedy):
    path = f"/v2/models/{MODEL_NAME}/generate"
    status, body = post(server, path, {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "bad_words": "",
                                       "stop_words": ""})
    assert status == 200 and body == {"model_name": MODEL_NAME, "model_version": "1",
                                      "text_output": PROMPT + greedy(PROMPT)[0]}
    status, body = post(server, f"/v2/models/{MODEL_NAME}/versions/1/generate",
                        {"text_input": PROMPT, "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0,
                                                              "exclude_input_in_output": True, "priority": 1}})
    assert status == 200 and body["text_output"] == greedy(PROMPT)[0]
    status, body = post(server, path, {"text_input": PROMPT, "max_tokens": [MAX_TOKENS], "return_log_probs": True,
                                       "exclude_input_in_output": True})
    expected_text, expected_logprobs = greedy(PROMPT)
    assert status == 200 and body["text_output"] == expected_text
    np.testing.assert_allclose(body["output_log_probs"], expected_logprobs, rtol=1e-4, atol=1e-4)
    assert body["cum_log_probs"] == pytest.approx(sum(body["output_log_probs"]))


def test_generate_stop_words(server, greedy):
    text, _ = greedy(PROMPT)
    stop = text.strip()[:3]
    status, body = post(server, f"/v2/models/{MODEL_NAME}/generate",
                        {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "stop_words": [stop],
                         "exclude_input_in_output": True})
    assert status == 200 and body["text_output"] == text[:text.index(stop)]


def test_generate_stream(server, greedy):
    events = stream_events(server, f"/v2/models/{MODEL_NAME}/generate_stream",
                           {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "return_log_probs": True})
    text, logprobs = greedy(PROMPT)
    assert len(events) > 1 and all(e["model_name"] == MODEL_NAME for e in events)
    assert "".join(e["text_output"] for e in events) == text  # pieces never repeat the prompt
    streamed = [lp for e in events for lp in e["output_log_probs"]]
    np.testing.assert_allclose(streamed, logprobs, rtol=1e-4, atol=1e-4)
    assert events[-1]["cum_log_probs"] == pytest.approx(sum(logprobs), abs=1e-3)


def test_generate_stream_error_after_start_is_an_event(server, monkeypatch):
    real_generate = server.service.generate

    async def fails_after_one_piece(prompt, params, request_id=None, **options):
        async with contextlib.aclosing(real_generate(prompt, params, request_id, **options)) as stream:
            async for delta in stream:
                yield delta
                raise RuntimeError("the engine fell over")

    monkeypatch.setattr(server.service, "generate", fails_after_one_piece)
    events = stream_events(server, f"/v2/models/{MODEL_NAME}/generate_stream",
                           {"text_input": PROMPT, "max_tokens": MAX_TOKENS})
    assert len(events) >= 2 and all("text_output" in e for e in events[:-1])
    assert events[-1] == {"error": "internal error: the engine fell over"}
    monkeypatch.undo()
    assert_blocks_free(server)


BAD_GENERATE = [
    (b"{", "not valid JSON"),
    (DEEP, "not valid JSON"),
    (b'"text"', "JSON object"),
    ({"max_tokens": 4}, "'text_input'"),
    ({"text_input": PROMPT, "max_tokens": "20"}, "max_tokens"),
    ({"text_input": PROMPT, "max_tokens": 4, "top_p": 2.0}, "top_p"),
    ({"text_input": PROMPT, "max_tokens": 4, "temperature": True}, "temperature"),
    ({"text_input": PROMPT, "max_tokens": [4, 5]}, "max_tokens"),
    ({"text_input": PROMPT, "max_tokens": 4, "prompt": "x"}, "unknown field 'prompt'"),
    ({"text_input": PROMPT, "max_tokens": 4, "parameters": {"max_tokens": 5}}, "'max_tokens' is given twice"),
    ({"text_input": PROMPT, "max_tokens": 4, "parameters": "fast"}, "'parameters'"),
    ({"text_input": PROMPT, "max_tokens": 4, "stop_words": [1]}, "stop_words"),
    ({"text_input": PROMPT, "max_tokens": MAX_SEQ_LEN}, "max_tokens"),
    ({"text_input": PROMPT, "max_tokens": 4, "beam_width": 2}, "beam_width"),
]


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
@pytest.mark.parametrize("body, message", BAD_GENERATE, ids=[m for _, m in BAD_GENERATE])
def test_generate_rejects_bad_requests(server, endpoint, body, message):
    status, response = post(server, f"/v2/models/{MODEL_NAME}/{endpoint}", body)
    assert status == 400, response
    assert message in response["error"]


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_client_that_disconnects_aborts_its_request(server, endpoint):
    aborted = aborted_requests(server)
    host, port = server.http_url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    # a rare end token instead of EOS: the request runs long unless aborted
    body = json.dumps({"text_input": PROMPT, "max_tokens": 900, "end_id": 8191}).encode()
    connection.request("POST", f"/v2/models/{MODEL_NAME}/{endpoint}", body, {"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while server.kv_cache_stats()["free_blocks"] == server.kv_cache_stats()["total_blocks"]:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    if endpoint == "generate_stream":
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.sock.close()
    connection.close()
    assert_blocks_free(server, timeout=2.0)
    assert server.service.num_inflight == 0 and aborted_requests(server) == aborted + 1


def test_still_serving_with_all_blocks_free(client, server, greedy):
    assert client.is_server_ready()
    result = client.infer(MODEL_NAME, inputs([PROMPT]))
    assert result.as_numpy("text_output")[0, 0] == (PROMPT + greedy(PROMPT)[0]).encode()
    assert_blocks_free(server)
