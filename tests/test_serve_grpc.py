"""`kiln serve` over Triton's gRPC protocol, through the real tritonclient.grpc client."""

from __future__ import annotations

import queue
import time
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from serve_util import MODEL_NAME, start_server
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

import kiln
from kiln.runtime import LLM, SamplingParams
from kiln.serve.errors import InvalidRequest
from kiln.serve.kserve.grpc_server import decode_inputs
from kiln.serve.tritonserver.logits_outputs import EXTRA_OUTPUTS
from kiln.serve.tritonserver.schema import DATATYPES

PROMPTS = ["def add(a, b):", "import os\n"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(server):
    c = triton.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(tiny_code_engine):
    """Greedy completions (with log probs) of PROMPTS, in process."""
    outs = LLM(tiny_code_engine).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=True))
    return {prompt: out for prompt, out in zip(PROMPTS, outs)}


def tensor(name: str, values, datatype: str) -> triton.InferInput:
    array = np.array(values, dtype=DATATYPES[datatype][1])
    t = triton.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def inputs(prompts=(PROMPTS[0],), max_tokens=MAX_TOKENS, **scalars) -> list[triton.InferInput]:
    """One row per prompt; scalars as (value, datatype), repeated on every row."""
    rows = len(prompts)
    result = [tensor("text_input", [[p.encode()] for p in prompts], "BYTES"),
              tensor("max_tokens", [[max_tokens]] * rows, "INT32")]
    return result + [tensor(name, [[value]] * rows, datatype) for name, (value, datatype) in scalars.items()]


def wait_until_idle(server, timeout: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.kv_cache_stats()
        if (server.service.num_inflight == 0 and stats["free_blocks"] == stats["total_blocks"]) \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def aborted_requests(server) -> float:
    for line in urllib.request.urlopen(server.metrics_url, timeout=10).read().decode().splitlines():
        if line.startswith('kiln_requests_total{outcome="abort"}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no abort counter in the metrics")


class Stream:
    """A tritonclient stream on `client` whose callback queues (result, error) pairs."""

    def __init__(self, client, **kwargs) -> None:
        self.client = client
        self.results: queue.Queue = queue.Queue()
        client.start_stream(lambda result, error: self.results.put((result, error)), **kwargs)

    def next(self, timeout: float = 30.0):
        return self.results.get(timeout=timeout)

    def until_final(self, count: int = 1) -> tuple[dict[str, list], list[InferenceServerException]]:
        """Responses by request id until `count` requests have ended (a final response or an error)."""
        responses: dict[str, list] = {}
        errors = []
        while count:
            result, error = self.next()
            if error is not None:
                errors.append(error)
                count -= 1
                continue
            response = result.get_response()
            responses.setdefault(response.id, []).append(result)
            count -= response.parameters["triton_final_response"].bool_param
        return responses, errors


def final_flags(results) -> list[bool]:
    return [r.get_response().parameters["triton_final_response"].bool_param for r in results]


def text(result) -> str:
    return result.as_numpy("text_output")[0, 0].decode()


# ---- health and metadata -------------------------------------------------------------------------------
def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL_NAME)
    assert client.is_model_ready(MODEL_NAME, model_version="1")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "kiln" and meta["version"] == kiln.__version__
    assert "model_configuration" in meta["extensions"]
    model = client.get_model_metadata(MODEL_NAME, as_json=True)
    assert model["name"] == MODEL_NAME and model["versions"] == ["1"]
    assert {"name": "text_input", "datatype": "BYTES", "shape": ["-1", "1"]} in model["inputs"]
    assert [o["name"] for o in model["outputs"]] == ["text_output", "output_log_probs", "cum_log_probs",
                                                     "output_ids", "sequence_length", *EXTRA_OUTPUTS]
    config = client.get_model_config(MODEL_NAME, as_json=True)["config"]
    assert config["name"] == MODEL_NAME and config["max_batch_size"] == 16
    assert config["model_transaction_policy"]["decoupled"] is True


@pytest.mark.parametrize("call", [
    lambda c: c.is_model_ready("nope"),
    lambda c: c.get_model_metadata("nope"),
    lambda c: c.get_model_config(MODEL_NAME, model_version="2"),
    lambda c: c.infer("nope", inputs()),
])
def test_unknown_model_or_version_is_not_found(client, call):
    with pytest.raises(InferenceServerException) as e:
        call(client)
    assert e.value.status() == "StatusCode.NOT_FOUND"
    assert "'nope'" in e.value.message() or "version '2'" in e.value.message()


def test_unimplemented_rpcs_say_so(client):
    with pytest.raises(InferenceServerException) as e:
        client.get_inference_statistics(MODEL_NAME)
    assert e.value.status() == "StatusCode.UNIMPLEMENTED" and "ModelStatistics" in e.value.message()


# ---- ModelInfer -----------------------------------------------------------------------------------------
def test_infer_matches_greedy_reference(client, reference):
    result = client.infer(MODEL_NAME, inputs(), request_id="r1")
    assert result.get_response().id == "r1" and result.get_response().model_version == "1"
    assert result.as_numpy("text_output").shape == (1, 1)
    assert text(result) == PROMPTS[0] + reference[PROMPTS[0]].text
    result = client.infer(MODEL_NAME, inputs(exclude_input_in_output=(True, "BOOL")))
    assert text(result) == reference[PROMPTS[0]].text


def test_infer_batch_runs_every_row(client, reference):
    result = client.infer(MODEL_NAME, inputs(PROMPTS, exclude_input_in_output=(True, "BOOL")),
                          outputs=[triton.InferRequestedOutput("text_output")])
    assert [t.decode() for t in result.as_numpy("text_output")[:, 0]] == [reference[p].text for p in PROMPTS]
    assert result.as_numpy("output_log_probs") is None


def test_infer_log_probs(client, reference):
    result = client.infer(MODEL_NAME, inputs(return_log_probs=(True, "BOOL")))
    logprobs, cum = result.as_numpy("output_log_probs"), result.as_numpy("cum_log_probs")
    expected = reference[PROMPTS[0]]
    assert logprobs.shape == (1, 1, len(expected.token_ids)) and cum.shape == (1, 1)  # [batch, beam(, len)]
    np.testing.assert_allclose(logprobs[0, 0], expected.logprobs, rtol=1e-4, atol=1e-4)
    assert cum[0, 0] == pytest.approx(logprobs[0, 0].sum(), abs=1e-4)


def test_infer_with_contents_instead_of_raw(server, reference):
    """Clients other than tritonclient may put tensors in `contents`; the raw stub sends them so."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc_url))
    tensor_ = pb.ModelInferRequest.InferInputTensor
    request = pb.ModelInferRequest(model_name=MODEL_NAME, id="c", inputs=[
        tensor_(name="text_input", datatype="BYTES", shape=[1, 1],
                contents=pb.InferTensorContents(bytes_contents=[PROMPTS[1].encode()])),
        tensor_(name="max_tokens", datatype="INT32", shape=[1, 1],
                contents=pb.InferTensorContents(int_contents=[MAX_TOKENS]))])
    response = stub.ModelInfer(request, timeout=30)
    assert response.id == "c" and [o.name for o in response.outputs] == ["text_output"]
    assert triton.InferResult(response).as_numpy("text_output")[0, 0].decode() == PROMPTS[1] + reference[PROMPTS[1]].text


def test_decode_inputs_checks_sizes():
    tensor_ = pb.ModelInferRequest.InferInputTensor
    request = pb.ModelInferRequest(inputs=[tensor_(name="max_tokens", datatype="INT32", shape=[1, 2])],
                                   raw_input_contents=[np.array([4], "<i4").tobytes()])
    with pytest.raises(InvalidRequest, match=r"'max_tokens' has 1 elements in raw_input_contents but its shape \[1, 2\]"):
        decode_inputs(request)
    request = pb.ModelInferRequest(inputs=[tensor_(name="text_input", datatype="BYTES", shape=[1, 1])],
                                   raw_input_contents=[b"\x09\x00\x00\x00abc"])
    with pytest.raises(InvalidRequest, match="says 9 bytes"):
        decode_inputs(request)
    request.raw_input_contents[0] = b"\x03\x00\x00\x00abc\x01\x00\x00\x00d"
    request.inputs[0].shape[:] = [1, 2]
    assert decode_inputs(request)["text_input"].tolist() == [[b"abc", b"d"]]


@pytest.mark.parametrize("bad_inputs, status, message", [
    (lambda: inputs()[:1] + [tensor("max_tokens", [[4]], "INT64")], "INVALID_ARGUMENT",
     "input 'max_tokens' has datatype INT64; the model expects INT32"),
    (lambda: inputs(temprature=(0.5, "FP32")), "INVALID_ARGUMENT", "unknown input 'temprature'"),
    (lambda: inputs(top_p=(2.0, "FP32")), "INVALID_ARGUMENT", "top_p"),
    (lambda: inputs()[1:], "INVALID_ARGUMENT", "missing required input 'text_input'"),
    (lambda: inputs(["x " * 3000]), "INVALID_ARGUMENT", "exceeds max_seq_len"),
    (lambda: inputs(PROMPTS * 9), "INVALID_ARGUMENT", "max_batch_size 16"),
])
def test_bad_requests_are_refused_and_the_server_keeps_serving(client, reference, bad_inputs, status, message):
    with pytest.raises(InferenceServerException) as e:
        client.infer(MODEL_NAME, bad_inputs())
    assert e.value.status() == f"StatusCode.{status}"
    assert message in e.value.message()
    assert text(client.infer(MODEL_NAME, inputs())) == PROMPTS[0] + reference[PROMPTS[0]].text


def test_request_larger_than_max_request_bytes_is_refused(server, client, reference):
    with pytest.raises(InferenceServerException) as e:
        client.infer(MODEL_NAME, inputs(["x" * server.config.max_request_bytes]))
    assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert text(client.infer(MODEL_NAME, inputs())) == PROMPTS[0] + reference[PROMPTS[0]].text


def test_unrequested_log_probs_output_is_zero_not_an_error(client):
    result = client.infer(MODEL_NAME, inputs(), outputs=[triton.InferRequestedOutput("cum_log_probs")])
    assert result.as_numpy("cum_log_probs").tolist() == [[0.0]]


def test_cancelled_infer_aborts_its_requests(server, client):
    before = aborted_requests(server)
    long = inputs(PROMPTS, max_tokens=900, end_id=(2, "INT32"))  # end_id = pad: runs to max_tokens
    call = client.async_infer(MODEL_NAME, long, callback=lambda result, error: None)
    deadline = time.monotonic() + 10
    while server.service.num_inflight < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    call.cancel()
    stats = wait_until_idle(server)
    assert stats["free_blocks"] == stats["total_blocks"] and server.service.num_inflight == 0
    assert aborted_requests(server) == before + 2


def test_cancelling_at_any_moment_leaves_the_server_whole(server, client, reference):
    """Cancels land before, during and after the engine admits the requests."""
    long = inputs(PROMPTS, max_tokens=900, end_id=(2, "INT32"))
    for delay in np.linspace(0, 0.03, 16):
        call = client.async_infer(MODEL_NAME, long, callback=lambda result, error: None)
        time.sleep(delay)
        call.cancel()
    stats = wait_until_idle(server)
    assert stats["free_blocks"] == stats["total_blocks"] and server.service.num_inflight == 0
    assert server.service.ready
    assert text(client.infer(MODEL_NAME, inputs())) == PROMPTS[0] + reference[PROMPTS[0]].text


# ---- ModelStreamInfer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("empty_final", [False, True])
def test_stream_pieces_add_up_to_the_greedy_completion(client, reference, empty_final):
    stream = Stream(client)
    try:
        client.async_stream_infer(MODEL_NAME, inputs(stream=(True, "BOOL"), return_log_probs=(True, "BOOL")),
                                  request_id="s", enable_empty_final_response=empty_final)
        responses, errors = stream.until_final()
    finally:
        client.stop_stream()
    results = responses["s"]
    assert not errors and len(results) > 2
    if empty_final:
        results, last = results[:-1], results[-1]
        assert last.get_response().outputs == [] and final_flags([last]) == [True]
        assert not any(final_flags(results))
    else:
        assert final_flags(results) == [False] * (len(results) - 1) + [True]
    assert "".join(text(r) for r in results) == reference[PROMPTS[0]].text
    logprobs = np.concatenate([r.as_numpy("output_log_probs")[0, 0] for r in results])
    assert len(logprobs) == len(reference[PROMPTS[0]].token_ids)
    assert results[-1].as_numpy("cum_log_probs")[0, 0] == pytest.approx(logprobs.sum(), abs=1e-4)


def test_stream_multiplexes_requests_and_reports_errors_per_request(client, reference):
    stream = Stream(client)
    try:
        client.async_stream_infer(MODEL_NAME, inputs(stream=(True, "BOOL")), request_id="a")
        client.async_stream_infer(MODEL_NAME, inputs([PROMPTS[1]]), request_id="b")
        client.async_stream_infer(MODEL_NAME, inputs(top_p=(2.0, "FP32")), request_id="bad")
        client.async_stream_infer(MODEL_NAME, inputs(PROMPTS, stream=(True, "BOOL")), request_id="batch")
        client.async_stream_infer(MODEL_NAME, inputs(PROMPTS, exclude_input_in_output=(True, "BOOL")),
                                  request_id="c", enable_empty_final_response=True)
        responses, errors = stream.until_final(5)
    finally:
        client.stop_stream()
    assert sorted(responses) == ["a", "b", "c"]
    assert "".join(text(r) for r in responses["a"]) == reference[PROMPTS[0]].text
    assert [text(r) for r in responses["b"]] == [PROMPTS[1] + reference[PROMPTS[1]].text]
    assert final_flags(responses["b"]) == [True]
    assert final_flags(responses["c"]) == [False, True]
    batch = responses["c"][0].as_numpy("text_output")
    assert [t.decode() for t in batch[:, 0]] == [reference[p].text for p in PROMPTS]
    assert sorted(e.message() for e in errors)[0].startswith("input 'stream' is true with batch size 2")
    assert any("top_p" in e.message() for e in errors)


def test_cancelled_stream_aborts_its_requests(server, client):
    before = aborted_requests(server)
    stream = Stream(client)
    try:
        for request_id in ("x", "y"):
            client.async_stream_infer(MODEL_NAME, inputs(max_tokens=900, stream=(True, "BOOL"), end_id=(2, "INT32")),
                                      request_id=request_id)
        result, error = stream.next()
        assert error is None and not final_flags([result])[0]
    finally:
        client.stop_stream(cancel_requests=True)
    stats = wait_until_idle(server)
    assert stats["free_blocks"] == stats["total_blocks"] and server.service.num_inflight == 0
    assert aborted_requests(server) == before + 2


# ---- API key --------------------------------------------------------------------------------------------
def test_api_key_is_required_when_configured(tiny_code_engine, reference):
    srv = start_server(tiny_code_engine, api_key="secret")
    c = triton.InferenceServerClient(srv.grpc_url)
    try:
        assert c.is_server_live() and c.is_server_ready()  # probes stay open
        for call in (lambda **h: c.get_model_metadata(MODEL_NAME, **h), lambda **h: c.infer(MODEL_NAME, inputs(), **h)):
            for headers in ({}, {"headers": {"authorization": "Bearer wrong"}}):
                with pytest.raises(InferenceServerException) as e:
                    call(**headers)
                assert e.value.status() == "StatusCode.UNAUTHENTICATED"
        good = {"authorization": "Bearer secret"}
        assert c.is_model_ready(MODEL_NAME, headers=good)
        assert text(c.infer(MODEL_NAME, inputs(), headers=good)) == PROMPTS[0] + reference[PROMPTS[0]].text

        stream = Stream(c)  # refused as soon as it opens, before any request
        _, error = stream.next()
        assert error.status() == "StatusCode.UNAUTHENTICATED" and "API key" in error.message()
        c.stop_stream()
        stream = Stream(c, headers=good)
        c.async_stream_infer(MODEL_NAME, inputs(), request_id="k")
        responses, errors = stream.until_final()
        c.stop_stream()
        assert not errors and final_flags(responses["k"]) == [True]
    finally:
        c.close()
        srv.stop()
