"""Triton's own tools against `kiln serve`: requests shaped as perf_analyzer and genai-perf (Triton/TensorRT-LLM
mode) send them, which ask for every output the model metadata lists; and a gRPC port that is taken."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serve_util import MODEL_NAME, start_server, stream_results

from kiln.cli import main
from kiln.runtime import LLM, SamplingParams
from kiln.serve.tritonserver.logits_outputs import EXTRA_OUTPUTS
from kiln.serve.tritonserver.schema import DATATYPES

PROMPTS = ["def add(a, b):", "class Stack:"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def greedy(tiny_code_engine):
    """prompt -> its greedy RequestOutput (with log probs), in process."""
    outs = LLM(tiny_code_engine).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                  logprobs=True))
    return dict(zip(PROMPTS, outs))


def _inputs(module, prompts=(PROMPTS[0],), **scalars):
    """text_input and max_tokens (what perf_analyzer's input data for an LLM holds), plus scalars as
    (value or one value per row, datatype)."""
    def tensor(name, values, datatype):
        array = np.array(values, dtype=DATATYPES[datatype][1])
        t = module.InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        return t

    rows = len(prompts)
    result = [tensor("text_input", [[p.encode()] for p in prompts], "BYTES"),
              tensor("max_tokens", [[MAX_TOKENS]] * rows, "INT32")]
    for name, (value, datatype) in scalars.items():
        values = value if isinstance(value, list) else [value] * rows
        result.append(tensor(name, [[v] for v in values], datatype))
    return result


def _all_outputs(client, module, **kwargs):
    """Every output the model metadata lists, as perf_analyzer asks for them."""
    metadata = client.get_model_metadata(MODEL_NAME)
    names = [o["name"] for o in metadata["outputs"]] if isinstance(metadata, dict) else \
        [o.name for o in metadata.outputs]
    assert names == ["text_output", "output_log_probs", "cum_log_probs", "output_ids", "sequence_length",
                     *EXTRA_OUTPUTS]  # logits and perf metrics: zeros unless asked (test_logits_outputs.py)
    return [module.InferRequestedOutput(name, **kwargs) for name in names]


def _check_without_log_probs(result, prompts, greedy):
    texts = [t if isinstance(t, str) else t.decode() for t in result.as_numpy("text_output").ravel()]
    assert texts == [p + greedy[p].text for p in prompts]
    logprobs, cum = result.as_numpy("output_log_probs"), result.as_numpy("cum_log_probs")
    assert logprobs.dtype == np.float32 and logprobs.shape == (len(prompts), 1, 0)  # [batch, beam, len]
    assert cum.dtype == np.float32 and cum.shape == (len(prompts), 1) and not cum.any()


@pytest.fixture(scope="module")
def http(server):
    c = httpclient.InferenceServerClient(url=server.http_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def grpc(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


# ---- every output, without return_log_probs ---------------------------------------------------------
@pytest.mark.parametrize("binary", [True, False])
def test_http_infer_answers_every_listed_output_without_return_log_probs(http, greedy, binary):
    outputs = _all_outputs(http, httpclient, binary_data=binary)
    result = http.infer(MODEL_NAME, _inputs(httpclient, PROMPTS), outputs=outputs)
    _check_without_log_probs(result, PROMPTS, greedy)


def test_grpc_model_infer_answers_every_listed_output_without_return_log_probs(grpc, greedy):
    result = grpc.infer(MODEL_NAME, _inputs(grpcclient, PROMPTS), outputs=_all_outputs(grpc, grpcclient))
    _check_without_log_probs(result, PROMPTS, greedy)


@pytest.mark.parametrize("stream", [True, False])
def test_grpc_stream_answers_every_listed_output_without_return_log_probs(grpc, greedy, stream):
    """perf_analyzer --streaming (and genai-perf, which streams) on the decoupled model."""
    responses: queue.Queue = queue.Queue()
    grpc.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        grpc.async_stream_infer(MODEL_NAME, _inputs(grpcclient, stream=(stream, "BOOL")),
                                outputs=_all_outputs(grpc, grpcclient), request_id="pa")
        results = stream_results(responses)
    finally:
        grpc.stop_stream()
    assert len(results) > 1 if stream else len(results) == 1
    text = "".join(r.as_numpy("text_output")[0, 0].decode() for r in results)
    assert text == (greedy[PROMPTS[0]].text if stream else PROMPTS[0] + greedy[PROMPTS[0]].text)
    for r in results:
        assert r.as_numpy("output_log_probs").shape == (1, 1, 0) and r.as_numpy("cum_log_probs").tolist() == [[0.0]]


def test_a_batch_mixing_return_log_probs_pads_the_rows_without(http, greedy):
    result = http.infer(MODEL_NAME, _inputs(httpclient, PROMPTS, return_log_probs=([True, False], "BOOL")),
                        outputs=_all_outputs(http, httpclient))
    logprobs, cum = result.as_numpy("output_log_probs"), result.as_numpy("cum_log_probs")
    first = greedy[PROMPTS[0]].logprobs
    np.testing.assert_allclose(logprobs[0, 0, :len(first)], first, rtol=1e-5, atol=1e-5)
    assert not logprobs[1].any() and cum[1, 0] == 0.0
    assert cum[0, 0] == pytest.approx(sum(first), abs=1e-4)


def test_an_unknown_output_is_still_refused(http):
    with pytest.raises(httpclient.InferenceServerException, match="unknown output 'logits'"):
        http.infer(MODEL_NAME, _inputs(httpclient), outputs=[httpclient.InferRequestedOutput("logits")])


# ---- a gRPC port that is taken ---------------------------------------------------------------------------
def test_a_taken_grpc_port_is_an_error_naming_it(server, tiny_code_engine, greedy, capsys):
    port = server.server.grpc_port
    with pytest.raises(OSError, match=f"gRPC port {port} on 127.0.0.1 is in use"):
        start_server(tiny_code_engine, grpc_port=port)
    assert main(["serve", "--engine", str(tiny_code_engine), "--http-port", "0", "--grpc-port", str(port),
                 "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln serve: error: cannot listen: ") and f"gRPC port {port}" in err
    # the first server still has the port to itself: new clients reach it
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        result = client.infer(MODEL_NAME, _inputs(grpcclient))
        assert result.as_numpy("text_output")[0, 0].decode() == PROMPTS[0] + greedy[PROMPTS[0]].text
    finally:
        client.close()
