"""`kiln serve` under abuse: requests that ask for too much work, and values Python takes but nothing after it can
use (integers of thousands of digits, lone surrogates, absurd tensor shapes). Each gets a 4xx naming the field,
limit or flag before any engine work starts; no engine error is counted, and the server keeps serving the same
greedy outputs with every KV block free."""

from __future__ import annotations

import json
import struct
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from serve_util import MODEL_NAME, counters, message, start_server
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from kiln.cli import main
from kiln.serve.config import ServeConfig

PROMPT = "def add(a, b):"
MESSAGES = [{"role": "user", "content": "Sort a list."}]
INFER = f"/v2/models/{MODEL_NAME}/infer"
GENERATE = f"/v2/models/{MODEL_NAME}/generate"
GENERATE_STREAM = f"/v2/models/{MODEL_NAME}/generate_stream"
HUGE = "1" + "0" * 5000  # more digits than Python parses (4300)
BIG = "1" + "0" * 400  # parses, but float() overflows on it
# Small limits for a second server: 3 prompts, n <= 8, 6 sequences, 40 prompt tokens per request.
LIMITS = dict(max_prompts_per_request=3, max_n=8, max_sequences_per_request=6, max_prompt_tokens_per_request=40)


# ---- helpers ---------------------------------------------------------------------------------------------
def post(server, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.http_base + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()  # an event stream


def wait_blocks_free(server, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.kv_cache_stats()
        if (stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def greedy_outputs(server) -> dict[str, str]:
    """What a few ordinary greedy requests answer, over each API."""
    _, completion = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    _, chat = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "temperature": 0})
    _, generate = post(server, GENERATE, {"text_input": PROMPT, "max_tokens": 8})
    _, infer = post(server, INFER, infer_body([PROMPT, "import os\n"], max_tokens=8))
    return {"completion": completion["choices"][0]["text"], "chat": chat["choices"][0]["message"]["content"],
            "generate": generate["text_output"], "infer": json.dumps(infer["outputs"])}


def infer_body(prompts: list[str], max_tokens: int = 4) -> dict:
    rows = len(prompts)
    return {"inputs": [{"name": "text_input", "shape": [rows, 1], "datatype": "BYTES", "data": prompts},
                       {"name": "max_tokens", "shape": [rows, 1], "datatype": "INT32", "data": [max_tokens] * rows}]}


def assert_refused_without_engine_work(server, send, status: int | str, expected: str) -> None:
    """`send()` -> (status, response); it must be refused with `expected` in the message, and count nothing."""
    before = counters(server)
    got, response = send()
    assert got == status, response
    assert expected in message(response), message(response)
    assert counters(server) == before  # no engine request: no error, rejection or prompt token counted
    assert client_ready(server)


def grpc_infer(server, text: grpcclient.InferInput, rows: int) -> tuple[str, dict]:
    """`text` and max_tokens=2 on each of `rows` rows through tritonclient.grpc -> (status, {"error": message})."""
    tokens = grpcclient.InferInput("max_tokens", [rows, 1], "INT32")
    tokens.set_data_from_numpy(np.full((rows, 1), 2, dtype=np.int32))
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.infer(MODEL_NAME, [text, tokens])
        return "StatusCode.OK", {"error": ""}
    except InferenceServerException as e:
        return e.status(), {"error": e.message()}
    finally:
        client.close()


def client_ready(server) -> bool:
    with urllib.request.urlopen(server.http_base + "/v2/health/ready", timeout=10) as response:
        return response.status == 200


@pytest.fixture(scope="module")
def before(server):
    """Greedy outputs before any abuse, to compare with those after."""
    return greedy_outputs(server)


@pytest.fixture(scope="module")
def limited(tiny_code_engine):
    """A server with small per-request limits (LIMITS)."""
    srv = start_server(tiny_code_engine, **LIMITS)
    yield srv
    srv.stop()


# ---- configuration ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", list(LIMITS))
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_config_rejects_limits_that_are_not_positive_integers(field, value):
    with pytest.raises(ValueError, match=f"ServeConfig.{field}="):
        ServeConfig(engine_dir="e", **{field: value})


def test_cli_flags_reach_the_config(monkeypatch, tmp_path):
    seen = []

    async def fake_serve(config):
        seen.append(config)

    monkeypatch.setattr("kiln.serve.server.serve", fake_serve)
    assert main(["serve", "--engine", str(tmp_path), "--max-prompts-per-request", "7", "--max-n", "9",
                 "--max-sequences-per-request", "11", "--max-prompt-tokens-per-request", "13"]) == 0
    assert (seen[0].max_prompts_per_request, seen[0].max_n, seen[0].max_sequences_per_request,
            seen[0].max_prompt_tokens_per_request) == (7, 9, 11, 13)
    main(["serve", "--engine", str(tmp_path)])
    assert (seen[1].max_prompts_per_request, seen[1].max_n, seen[1].max_sequences_per_request,
            seen[1].max_prompt_tokens_per_request) == (256, 128, 1024, 2**20)
    assert main(["serve", "--engine", str(tmp_path), "--max-n", "0"]) == 2  # refused, naming the field


# ---- too much work in one request (the defaults) ------------------------------------------------------------
def test_many_prompts_are_refused_before_anything_is_tokenized(server, before):
    body = json.dumps({"prompt": ["a"] * 300_000, "max_tokens": 1}).encode()  # 1.5 MB, within the body limit
    assert_refused_without_engine_work(server, lambda: post(server, "/v1/completions", body), 400,
                                       "request has 300000 prompts; this server takes at most 256 per request "
                                       "(--max-prompts-per-request)")


@pytest.mark.parametrize("stream", [False, True])
def test_prompts_times_n_is_limited(server, before, stream):
    body = {"prompt": [PROMPT] * 100, "n": 128, "max_tokens": 1, "stream": stream}
    assert_refused_without_engine_work(server, lambda: post(server, "/v1/completions", body), 400,
                                       "request asks for 12800 sequences (100 prompt(s) × n=128); this server takes "
                                       "at most 1024 per request (--max-sequences-per-request)")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "n": 129}),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 129}),
])
def test_n_is_limited(server, before, path, body):
    assert_refused_without_engine_work(server, lambda: post(server, path, body), 400,
                                       "n=129 is invalid: must be an integer in [1, 128] (--max-n)")


def test_prompt_tokens_are_limited(server, before):
    body = {"prompt": [[5] * 4097] * 256, "max_tokens": 1}  # 256 prompts of 4097 token ids: 1,048,832 tokens
    assert_refused_without_engine_work(server, lambda: post(server, "/v1/completions", body), 400,
                                       "this server takes at most 1048576 per request "
                                       "(--max-prompt-tokens-per-request)")


# ---- too much work in one request (small limits) ------------------------------------------------------------
LONG = "x = 1\n" * 20  # more than 40 tokens
LIMITED = [
    ("/v1/completions", {"prompt": ["a", "b", "c", "d"]},
     "request has 4 prompts; this server takes at most 3 per request (--max-prompts-per-request)"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 4},
     "request asks for 8 sequences (2 prompt(s) × n=4); this server takes at most 6 per request "
     "(--max-sequences-per-request)"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 7},
     "request asks for 7 sequences (1 prompt(s) × n=7); this server takes at most 6"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 9}, "must be an integer in [1, 8] (--max-n)"),
    ("/v1/completions", {"prompt": [PROMPT, LONG]}, "this server takes at most 40 per request "
     "(--max-prompt-tokens-per-request)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]},
     "(--max-prompt-tokens-per-request)"),
    (INFER, infer_body(["a"] * 7),
     "request has 7 batch rows; this server takes at most 6 sequences per request (--max-sequences-per-request)"),
    (INFER, infer_body([PROMPT, LONG]),
     "batch row 1: request has at least"),
]


@pytest.mark.parametrize("path, body, expected", LIMITED, ids=[f"{p.rsplit('/', 1)[1]}-{i}"
                                                              for i, (p, _, _) in enumerate(LIMITED)])
def test_small_limits(limited, path, body, expected):
    body = {"max_tokens": 2, **body} if not path.startswith("/v2") else body
    assert_refused_without_engine_work(limited, lambda: post(limited, path, body), 400, expected)


def test_limits_refuse_over_grpc(limited):
    text = grpcclient.InferInput("text_input", [7, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"a"]] * 7, dtype=np.object_))
    assert_refused_without_engine_work(limited, lambda: grpc_infer(limited, text, rows=7), "StatusCode.INVALID_ARGUMENT",
                                       "request has 7 batch rows; this server takes at most 6 sequences per request "
                                       "(--max-sequences-per-request)")


def test_requests_within_the_small_limits_run(limited):
    status, response = post(limited, "/v1/completions", {"prompt": [PROMPT, "b", "c"], "n": 2, "max_tokens": 2,
                                                         "temperature": 0})
    assert status == 200 and len(response["choices"]) == 6
    status, response = post(limited, INFER, infer_body(["a"] * 6, max_tokens=2))
    assert status == 200 and len(response["outputs"][0]["data"]) == 6
    stats = wait_blocks_free(limited)
    assert stats["free_blocks"] == stats["total_blocks"]


# ---- values Python takes but nothing after it can use ---------------------------------------------------------
def raw(text: str) -> bytes:
    """A JSON body written by hand (huge integers, lone surrogate escapes)."""
    return text.encode()


CHAT = '{"messages": [{"role": "user", "content": "hi"}], '
INFER_JSON = ('{"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": [%s]}, '
              '{"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [%s]}%s]}')
TEMPERATURE = ', {"name": "temperature", "datatype": "FP32", "shape": [1, 1], "data": [%s]}'
UNUSABLE = [
    # integers of thousands of digits
    ("/v1/completions", f'{{"prompt": "x", "max_tokens": {HUGE}}}', "max_tokens=<an integer of 5001 digits>"),
    ("/v1/completions", f'{{"prompt": "x", "max_tokens": 2, "temperature": {HUGE}}}', "temperature=<an integer"),
    ("/v1/completions", f'{{"prompt": "x", "max_tokens": 2, "temperature": {BIG}}}',
     "temperature=<an integer of 401 digits>"),
    ("/v1/completions", f'{{"prompt": "x", "max_tokens": 2, "n": {BIG}}}', "n=<an integer of 401 digits> is invalid: must be an integer in [1, 128] (--max-n)"),
    ("/v1/completions", f'{{"prompt": [1, {BIG}], "max_tokens": 2}}', "prompt[1]=<an integer of 401 digits>"),
    ("/v1/chat/completions", CHAT + f'"max_tokens": {HUGE}}}', "max_tokens=<an integer of 5001 digits>"),
    ("/v1/chat/completions", CHAT + f'"max_completion_tokens": {BIG}}}', "max_completion_tokens=<an integer"),
    ("/v1/chat/completions", CHAT + f'"temperature": {HUGE}}}', "temperature=<an integer of 5001 digits>"),
    (GENERATE, f'{{"text_input": "x", "max_tokens": {HUGE}}}', "max_tokens=<an integer of 5001 digits>"),
    (GENERATE, f'{{"text_input": "x", "max_tokens": {BIG}}}', "input 'max_tokens' is INT32"),
    (GENERATE, f'{{"text_input": "x", "max_tokens": 2, "temperature": {HUGE}}}', "temperature=<an integer"),
    (GENERATE, f'{{"text_input": "x", "max_tokens": 2, "temperature": {BIG}}}', "input 'temperature' is FP32"),
    (GENERATE_STREAM, f'{{"text_input": "x", "max_tokens": {HUGE}}}', "max_tokens=<an integer of 5001 digits>"),
    (GENERATE_STREAM, f'{{"text_input": "x", "max_tokens": 2, "temperature": {BIG}}}', "input 'temperature'"),
    (INFER, INFER_JSON % ('"x"', HUGE, ""), "inputs[1].data[0]=<an integer of 5001 digits>"),
    (INFER, INFER_JSON % ('"x"', BIG, ""), "input 'max_tokens' is INT32"),
    (INFER, INFER_JSON % ('"x"', 2, TEMPERATURE % HUGE), "inputs[2].data[0]=<an integer of 5001 digits>"),
    (INFER, INFER_JSON % ('"x"', 2, TEMPERATURE % BIG), "input 'temperature' is FP32"),
    # lone surrogates
    ("/v1/completions", r'{"prompt": "a\ud800b", "max_tokens": 2}',
     r"prompt contains a lone surrogate (\ud800), which is not valid Unicode"),
    ("/v1/completions", r'{"prompt": ["ok", "a\udc00"], "max_tokens": 2}', r"prompt[1] contains a lone surrogate"),
    ("/v1/completions", r'{"prompt": "a\ud800", "max_tokens": 2, "echo": true}', "prompt contains a lone surrogate"),
    ("/v1/completions", r'{"prompt": "ab", "max_tokens": 2, "stop": ["\ud800"]}', "stop[0] contains a lone surrogate"),
    ("/v1/completions", r'{"prompt": "ab", "max_tokens": 2, "stop": "\ud800"}', "stop contains a lone surrogate"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "a\ud800"}], "max_tokens": 2}',
     r"messages[0].content contains a lone surrogate (\ud800)"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
     "messages[0].content[0].text contains a lone surrogate"),
    ("/v1/chat/completions", CHAT + r'"max_tokens": 2, "stop": ["\udfff"]}', r"stop[0] contains a lone surrogate (\udfff)"),
    (GENERATE, r'{"text_input": "a\ud800", "max_tokens": 2}',
     r"input 'text_input' contains a lone surrogate (\ud800), which is not valid Unicode"),
    (GENERATE, r'{"text_input": "ab", "max_tokens": 2, "stop_words": ["\ud800"]}',
     "input 'stop_words' contains a lone surrogate"),
    (GENERATE_STREAM, r'{"text_input": "a\ud800", "max_tokens": 2}', "input 'text_input' contains a lone surrogate"),
    (INFER, INFER_JSON % (r'"a\ud800"', 2, ""), "input 'text_input' contains a lone surrogate"),
]


@pytest.mark.parametrize("path, body, expected", UNUSABLE, ids=[f"{p.rsplit('/', 1)[1]}-{i}"
                                                               for i, (p, _, _) in enumerate(UNUSABLE)])
def test_unusable_values_are_400s_naming_the_field(server, before, path, body, expected):
    assert_refused_without_engine_work(server, lambda: post(server, path, raw(body)), 400, expected)


# ---- absurd tensor shapes, through the one Triton codec ----------------------------------------------------------
SHAPES = [[2**63 - 1, 0], [2**40, 2**40, 0], [1] * 100]


def shape_body(shape: list[int], binary: bool) -> tuple[bytes, dict]:
    """An infer request whose text_input has `shape` (and data for [1] * 100's one element)."""
    data = [PROMPT] if 0 not in shape else []
    text = {"name": "text_input", "datatype": "BYTES", "shape": shape}
    chunks = b"".join(struct.pack("<I", len(p)) + p.encode() for p in data)
    if binary:
        text["parameters"] = {"binary_data_size": len(chunks)}
    else:
        text["data"] = data
    header = json.dumps({"inputs": [text, {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1],
                                           "data": [2]}]}).encode()
    if not binary:
        return header, {}
    return header + chunks, {"Inference-Header-Content-Length": str(len(header))}


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("shape", SHAPES, ids=["2**63", "2**40x2**40", "100dims"])
def test_absurd_shapes_over_http(server, before, shape, binary):
    body, headers = shape_body(shape, binary)
    shown = str(shape) if len(shape) <= 8 else "[1, 1, 1, 1, 1, 1, 1, 1, ...] (100 dimensions)"
    assert_refused_without_engine_work(server, lambda: post(server, INFER, body, headers), 400,
                                       f"input 'text_input' has shape {shown}")


@pytest.mark.parametrize("shape", SHAPES, ids=["2**63", "2**40x2**40", "100dims"])
def test_absurd_shapes_over_grpc(server, before, shape):
    data = np.array([PROMPT.encode()] if 0 not in shape else [], dtype=np.object_)
    text = grpcclient.InferInput("text_input", [data.size], "BYTES")
    text.set_data_from_numpy(data)
    text.set_shape(shape)  # what a hostile client declares
    shown = str(shape) if len(shape) <= 8 else "[1, 1, 1, 1, 1, 1, 1, 1, ...] (100 dimensions)"
    assert_refused_without_engine_work(server, lambda: grpc_infer(server, text, rows=1), "StatusCode.INVALID_ARGUMENT",
                                       f"input 'text_input' has shape {shown}")


def test_absurd_shape_in_typed_contents_over_grpc(server, before):
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc_url))
    tensor = pb.ModelInferRequest.InferInputTensor
    request = pb.ModelInferRequest(model_name=MODEL_NAME, inputs=[
        tensor(name="text_input", datatype="BYTES", shape=[2**40, 2**40, 0], contents=pb.InferTensorContents()),
        tensor(name="max_tokens", datatype="INT32", shape=[1, 1], contents=pb.InferTensorContents(int_contents=[2]))])
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(request, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'text_input' has shape [1099511627776, 1099511627776, 0]" in e.value.details()


# ---- and the server is as it was ---------------------------------------------------------------------------
def test_after_all_that_the_server_serves_the_same_outputs(server, before):
    assert client_ready(server)
    stats = wait_blocks_free(server)
    assert stats["free_blocks"] == stats["total_blocks"] and server.service.num_inflight == 0
    assert greedy_outputs(server) == before
    assert counters(server)['kiln_requests_total{outcome="error"}'] == 0
