"""A request that fails alone once running (here: a grammar that compiles and allows "def", then nothing) gets
a clear error through every door of a real `kiln serve` — OpenAI (400 naming the field; a stream's error event
then [DONE]), Triton /generate and KServe HTTP infer (400), gRPC (INVALID_ARGUMENT, and an error response on a
stream) — while a concurrent stream goes on untouched and the server keeps serving with every KV block back."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serve_util import MODEL_NAME, post_json, start_server, triton_inputs
from tritonclient.utils import InferenceServerException

DEAD_END = 'root ::= "def" x\nx ::= x'


@pytest.fixture(scope="module")
def server(tiny_code_engine):
    srv = start_server(tiny_code_engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http_base + "/v1", api_key="none", max_retries=0)


def _all_blocks_back(server) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = server.kv_cache_stats()
        if stats["free_blocks"] == stats["total_blocks"] and server.service.num_inflight == 0:
            return True
        time.sleep(0.02)
    return False


class _Neighbour:
    """A long greedy stream running beside the failing requests; must end normally with all its tokens."""

    def __init__(self, client) -> None:
        self.usage = None
        self.thread = threading.Thread(target=self._run, args=(client,))
        self.thread.start()

    def _run(self, client) -> None:
        stream = client.completions.create(model=MODEL_NAME, prompt="def fibonacci(n):", max_tokens=48,
                                           temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                self.usage = chunk.usage

    def join(self) -> int:
        self.thread.join(60)
        return self.usage.completion_tokens


def test_openai_completion_and_chat_are_400s_naming_the_field(server, client):
    neighbour = _Neighbour(client)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL_NAME, prompt="x = ", max_tokens=8, extra_body={"guided_grammar": DEAD_END})
    assert "guided_grammar" in str(error.value) and "allows no token" in str(error.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       extra_body={"guided_grammar": DEAD_END})
    assert neighbour.join() == 48
    assert _all_blocks_back(server)


def test_openai_stream_ends_with_an_error_event_then_done(server):
    status, body = post_json(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "x = ", "max_tokens": 8,
                                                     "stream": True, "guided_grammar": DEAD_END})
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    if status == 200:  # the first token went out before the grammar ran dry
        assert events[-1] == "[DONE]", events
        error = json.loads(events[-2])["error"]
        assert error["code"] == 400 and "allows no token" in error["message"], error
    else:
        assert status == 400 and "allows no token" in body, body
    assert _all_blocks_back(server)


def test_triton_generate_and_kserve_infer_are_400s(server):
    status, body = post_json(server, f"/v2/models/{MODEL_NAME}/generate", {
        "text_input": "x = ", "max_tokens": 8, "guided_decoding_guide_type": "ebnf_grammar",
        "guided_decoding_guide": DEAD_END})
    assert status == 400 and "guided_decoding_guide" in body and "allows no token" in body, body
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        with pytest.raises(InferenceServerException) as error:
            client.infer(MODEL_NAME, _inputs(httpclient))
        assert "allows no token" in error.value.message()
    finally:
        client.close()
    assert _all_blocks_back(server)


def test_grpc_infer_and_stream(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as error:
            client.infer(MODEL_NAME, _inputs(grpcclient))
        assert error.value.status() == "StatusCode.INVALID_ARGUMENT" and "allows no token" in error.value.message()
        results = []
        client.start_stream(callback=lambda result, error: results.append((result, error)))
        client.async_stream_infer(MODEL_NAME, _inputs(grpcclient, stream=True))
        client.async_stream_infer(MODEL_NAME, _inputs(grpcclient, grammar=None, stream=True))
        client.stop_stream()
    finally:
        client.close()
    errors = [e for _, e in results if e is not None]
    assert len(errors) == 1 and "allows no token" in errors[0].message()
    texts = [r.as_numpy("text_output") for r, e in results if e is None and r is not None]
    assert texts  # the unconstrained request on the same stream was answered
    assert _all_blocks_back(server)


def _inputs(module, grammar: str | None = DEAD_END, stream: bool = False):
    return triton_inputs(module, "x = ", "ebnf_grammar" if grammar else None, grammar, 8, stream=(stream, "BOOL"))
