"""Beam search through every door of `kiln serve` and the Triton model (issue 35, item 2): tritonclient HTTP,
gRPC and gRPC streaming with beam_width 2 and 4, the generate extension, the Triton repository's model.py
(through tests/triton_stub, and once in a real Triton server where one is installed) and the openai package
with n + use_beam_search; each gives the beams `LLM.generate` gives with SamplingParams(use_beam_search=True,
n=B), in TensorRT-LLM's shapes ([batch, beam(, len)]). Widths over the engine's max_beam_width, and the
combinations that make no sense, are 4xx errors naming the field."""

from __future__ import annotations

import json
import queue
import sys
from pathlib import Path

import numpy as np
import pytest
from serve_util import EXAMPLES, MODEL_NAME, infer_inputs, post_json, start_server, stream_results

from kiln.runtime import LLM, SamplingParams
from kiln.serve.tritonserver.schema import DATATYPES, INPUT_SPECS

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def"]
MAX_TOKENS = 8
MAX_BEAM_WIDTH = 4
ALL_OUTPUTS = ("text_output", "output_ids", "sequence_length", "cum_log_probs", "output_log_probs")
# The Triton model reads a request naming every output as one naming none (Triton fills in all of them then),
# which gets the default outputs: so its tests name all but one.
MODEL_OUTPUTS = ["text_output", "output_ids", "sequence_length", "output_log_probs"]


@pytest.fixture(scope="module")
def beam_engine(tmp_path_factory):
    """kiln-tiny-code built in float32 with --max-beam-width 4 (as tests/test_beam_search.py)."""
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    return build_engine(EXAMPLES / "kiln-tiny-code", tmp_path_factory.mktemp("serve-beams") / "engine",
                        BuildConfig(dtype="float32", max_batch_size=16, max_num_tokens=256,
                                    max_beam_width=MAX_BEAM_WIDTH), progress=False)


@pytest.fixture(scope="module")
def expected(beam_engine):
    """{(prompt, width): (prompt ids, RequestOutput)} from LLM.generate, with logprobs."""
    llm = LLM(beam_engine)
    try:
        found = {}
        for width in (2, 4):
            params = SamplingParams(use_beam_search=True, n=width, max_tokens=MAX_TOKENS, logprobs=True)
            for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
                found[prompt, width] = out
        found["eos"] = min(llm.engine.eos_token_ids)
        return found
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def server(beam_engine):
    srv = start_server(beam_engine)
    yield srv
    srv.stop()


def check_beams(outputs: dict[str, np.ndarray], row: int, out, returned: int, eos: int, with_prompt: bool = True):
    """Row `row` of Triton outputs holds the first `returned` beams of `out` (a RequestOutput), in TensorRT-LLM's
    layout: output_ids padded with EOS after sequence_length, output_log_probs with 0 (cum_log_probs checked
    when present)."""
    prompt_ids = list(out.prompt_token_ids) if with_prompt else []
    beams = out.outputs[:returned]
    assert outputs["text_output"].shape[1] >= returned
    for j, beam in enumerate(beams):
        text = outputs["text_output"][row, j]
        assert (text.decode() if isinstance(text, bytes) else text).endswith(beam.text)
        ids = prompt_ids + list(beam.token_ids)
        length = int(outputs["sequence_length"][row, j])
        assert length == len(ids)
        assert outputs["output_ids"][row, j, :length].tolist() == ids
        assert set(outputs["output_ids"][row, j, length:].tolist()) <= {eos}
        logprobs = outputs["output_log_probs"][row, j]
        np.testing.assert_allclose(logprobs[:len(beam.token_ids)], beam.logprobs, atol=1e-4)
        assert not logprobs[len(beam.token_ids):].any()
        if "cum_log_probs" in outputs:
            assert outputs["cum_log_probs"][row, j] == pytest.approx(beam.cumulative_logprob, abs=1e-3)


# ---- tritonclient over HTTP and gRPC --------------------------------------------------------------------------
def triton_inputs(module, prompts, width=None, **scalars):
    """One row per prompt; `width` a beam width for every row, or a list of one per row."""
    arrays = {"text_input": np.array([[p.encode()] for p in prompts], dtype=np.object_),
              "max_tokens": np.array([[MAX_TOKENS]] * len(prompts), dtype=np.int32),
              "return_log_probs": np.array([[True]] * len(prompts), dtype=bool)}
    if width is not None:
        widths = width if isinstance(width, list) else [width] * len(prompts)
        arrays["beam_width"] = np.array([[w] for w in widths], dtype=np.int32)
    for name, value in scalars.items():
        arrays[name] = np.array([[value]] * len(prompts), dtype=DATATYPES[INPUT_SPECS[name].datatype][1])
    return infer_inputs(module, arrays)


def as_arrays(result) -> dict[str, np.ndarray]:
    return {name: result.as_numpy(name) for name in ALL_OUTPUTS}


@pytest.mark.parametrize("width", [2, 4])
def test_http_and_grpc_infer_return_the_engines_beams(server, expected, width):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    eos = min(server.service.llm.eos_token_ids)
    http = httpclient.InferenceServerClient(server.http_url)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for module, client in ((httpclient, http), (grpcclient, grpc)):
            outputs = [module.InferRequestedOutput(name) for name in ALL_OUTPUTS]
            result = as_arrays(client.infer(MODEL_NAME, triton_inputs(module, PROMPTS, width), outputs=outputs))
            assert result["text_output"].shape == (2, width)
            assert result["sequence_length"].shape == result["cum_log_probs"].shape == (2, width)
            assert result["output_ids"].shape[:2] == result["output_log_probs"].shape[:2] == (2, width)
            assert result["output_ids"].dtype == np.int32 and result["output_log_probs"].dtype == np.float32
            for row, prompt in enumerate(PROMPTS):
                out = expected[prompt, width]
                check_beams(result, row, out, width, eos)
                assert [t.decode() for t in result["text_output"][row]] == [prompt + b.text for b in out.outputs]
    finally:
        http.close()
        grpc.close()


def test_num_return_sequences_and_rows_of_other_widths(server, expected):
    import tritonclient.http as httpclient

    eos = min(server.service.llm.eos_token_ids)
    client = httpclient.InferenceServerClient(server.http_url)
    outputs = [httpclient.InferRequestedOutput(name) for name in ALL_OUTPUTS]
    result = as_arrays(client.infer(MODEL_NAME, triton_inputs(httpclient, PROMPTS, 4, num_return_sequences=2,
                                                              exclude_input_in_output=True), outputs=outputs))
    assert result["text_output"].shape == (2, 2)  # the 2 best of 4 beams
    for row, prompt in enumerate(PROMPTS):
        check_beams(result, row, expected[prompt, 4], 2, eos, with_prompt=False)
        assert [t.decode() for t in result["text_output"][row]] == [b.text for b in expected[prompt, 4].outputs[:2]]
    # a batch whose rows have different widths: the narrower row's missing beams are empty
    result = as_arrays(client.infer(MODEL_NAME, triton_inputs(httpclient, PROMPTS, [2, 4]), outputs=outputs))
    assert result["text_output"].shape == (2, 4)
    check_beams(result, 0, expected[PROMPTS[0], 2], 2, eos)
    check_beams(result, 1, expected[PROMPTS[1], 4], 4, eos)
    assert result["text_output"][0, 2:].tolist() == [b"", b""] and result["sequence_length"][0, 2:].tolist() == [0, 0]


def test_beam_width_1_keeps_todays_answer_with_a_beam_dimension(server):
    import tritonclient.http as httpclient

    with LLM(server.config.engine_dir) as llm:
        [out] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=True))
    client = httpclient.InferenceServerClient(server.http_url)
    outputs = [httpclient.InferRequestedOutput(name) for name in ALL_OUTPUTS]
    result = as_arrays(client.infer(MODEL_NAME, triton_inputs(httpclient, PROMPTS[:1], 1), outputs=outputs))
    assert result["text_output"].tolist() == [[(PROMPTS[0] + out.text).encode()]]
    assert result["output_log_probs"].shape == (1, 1, len(out.token_ids))
    check_beams(result, 0, out, 1, min(server.service.llm.eos_token_ids))


def test_grpc_stream_carries_the_current_beams(server, expected):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(lambda result, error: results.put((result, error)))
    try:
        outputs = [grpcclient.InferRequestedOutput(name) for name in ALL_OUTPUTS]
        client.async_stream_infer(MODEL_NAME, triton_inputs(grpcclient, PROMPTS[:1], 2, stream=True),
                                  outputs=outputs, request_id="beams")
        responses = stream_results(results, timeout=120)
    finally:
        client.stop_stream()
        client.close()
    assert len(responses) > 1  # one per step, each with both beams whole
    for result in responses:
        assert result.as_numpy("text_output").shape == (1, 2)
    out = expected[PROMPTS[0], 2]
    last = as_arrays(responses[-1])
    assert [t.decode() for t in last["text_output"][0]] == [b.text for b in out.outputs]  # never the prompt
    check_beams(last, 0, out, 2, min(server.service.llm.eos_token_ids), with_prompt=False)


def test_generate_extension_gives_a_list_per_output(server, expected):
    out = expected[PROMPTS[0], 2]
    status, body = post_json(server, f"/v2/models/{MODEL_NAME}/generate",
                             {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, "beam_width": 2,
                              "return_log_probs": True, "exclude_input_in_output": True})
    assert status == 200, body
    body = json.loads(body)
    assert body["text_output"] == [b.text for b in out.outputs]
    assert body["cum_log_probs"] == pytest.approx([b.cumulative_logprob for b in out.outputs], abs=1e-3)
    status, body = post_json(server, f"/v2/models/{MODEL_NAME}/generate_stream",
                             {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, "beam_width": 2})
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    assert status == 200 and len(events) > 1 and all(len(e["text_output"]) == 2 for e in events)
    assert events[-1]["text_output"] == [b.text for b in out.outputs]


@pytest.mark.parametrize("fields, named", [
    ({"beam_width": 5}, "beam_width"),
    ({"beam_width": 0}, "beam_width"),
    ({"beam_width": 2, "num_return_sequences": 3}, "num_return_sequences"),
    ({"num_return_sequences": 2}, "num_return_sequences"),
    ({"beam_width": 2, "temperature": 0.5}, "temperature"),
    ({"beam_width": 2, "len_penalty": 1.0, "length_penalty": 1.0}, "length_penalty"),
])
def test_triton_beam_errors_are_400_naming_the_input(server, fields, named):
    status, body = post_json(server, f"/v2/models/{MODEL_NAME}/generate",
                             {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, **fields})
    assert status == 400 and named in json.loads(body)["error"], body


def test_too_wide_is_refused_at_every_door_with_the_limit_and_the_flag(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    status, body = post_json(server, f"/v2/models/{MODEL_NAME}/generate",
                             {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, "beam_width": 5})
    message = json.loads(body)["error"]
    assert status == 400 and "beam_width=5" in message and "max_beam_width=4" in message
    assert "kiln build --max-beam-width 5" in message
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="max_beam_width=4") as error:
        client.infer(MODEL_NAME, triton_inputs(grpcclient, PROMPTS[:1], 5))
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
    client.close()


# ---- the OpenAI API, through the openai package ---------------------------------------------------------------
@pytest.fixture(scope="module")
def openai_client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.http_base}/v1", api_key="unused", max_retries=0)


def test_openai_completions_n_beams_best_first(openai_client, expected):
    response = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS, n=4,
                                                temperature=0, extra_body={"use_beam_search": True})
    assert [c.index for c in response.choices] == list(range(8))
    for i, prompt in enumerate(PROMPTS):
        assert [c.text for c in response.choices[4 * i:4 * i + 4]] == [b.text for b in expected[prompt, 4].outputs]
    assert response.usage.completion_tokens == sum(len(b.token_ids) for p in PROMPTS for b in expected[p, 4].outputs)


def test_openai_chat_n_beams(openai_client, beam_engine):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    response = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, n=2,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True})
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in response.choices)
    assert response.choices[0].message.content != response.choices[1].message.content


def test_openai_beam_errors(openai_client):
    import openai

    cases = [(dict(n=5, extra_body={"use_beam_search": True}), "n", "max_beam_width=4"),
             (dict(n=2, stream=True, extra_body={"use_beam_search": True}), "use_beam_search", "stream"),
             (dict(n=2, temperature=0.5, extra_body={"use_beam_search": True}), "temperature", "use_beam_search"),
             (dict(n=2, extra_body={"use_beam_search": True, "early_stopping": "soon"}), "early_stopping",
              "never")]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as error:
            openai_client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, **kwargs)
        assert error.value.body["param"] == param and words in error.value.body["message"], error.value.body


# ---- the Triton repository's model.py ----------------------------------------------------------------------
def test_the_triton_model_returns_beams_whole_and_streamed(beam_engine, expected, tmp_path):
    """model.py run as Triton's Python backend runs it, on tests/triton_stub's stand-in."""
    sys.path.insert(0, str(Path(__file__).parent / "triton_stub"))
    import triton_python_backend_utils as pb
    from test_triton_repo import execute, load_model, outputs_of, wait_for

    from kiln.cli import main

    assert main(["triton-repo", "--engine", str(beam_engine), "--output", str(tmp_path / "models")]) == 0
    model = load_model(tmp_path / "models" / beam_engine.name)
    try:
        eos = min(model.llm.eos_token_ids)

        def request(width, **scalars):
            tensors = [pb.Tensor("text_input", np.array([[PROMPTS[0].encode()]], dtype=np.object_))]
            for name, value in dict(max_tokens=MAX_TOKENS, beam_width=width, return_log_probs=True,
                                    **scalars).items():
                dtype = DATATYPES[INPUT_SPECS[name].datatype][1]
                tensors.append(pb.Tensor(name, np.array([[value]], dtype=dtype)))
            return pb.InferenceRequest(tensors, MODEL_OUTPUTS)

        whole, streaming, too_wide = request(4), request(2, stream=True), request(8)
        execute(model, whole, streaming, too_wide)
        for r in (whole, streaming, too_wide):
            wait_for(lambda r=r: r.sender.finished)
        check_beams(outputs_of(whole.sender.responses[0]), 0, expected[PROMPTS[0], 4], 4, eos)
        assert len(streaming.sender.responses) > 1
        last = outputs_of(streaming.sender.responses[-1])
        assert [t.decode() for t in last["text_output"][0]] == [b.text for b in expected[PROMPTS[0], 2].outputs]
        error = too_wide.sender.responses[0].error().message()
        assert "beam_width=8" in error and "--max-beam-width" in error
    finally:
        model.finalize()


def test_the_real_triton_server_returns_beams(beam_engine, expected, tmp_path):
    """Once in a real Triton server (skipped where none is installed, as tests/test_triton_server.py)."""
    from triton_server_util import Unavailable, find_install, layout_backend
    from triton_server_util import start_server as start_triton

    from kiln.serve.tritonserver.repository import write_repository

    try:
        install = find_install()
    except Unavailable as e:
        pytest.skip(str(e))

    backends, numpy_dir = layout_backend(install, tmp_path)
    repo = tmp_path / "models"
    write_repository(beam_engine, repo, model_name=MODEL_NAME, python_path=[numpy_dir] if numpy_dir else [])
    triton = start_triton(install, repo, backends, tmp_path / "tritonserver.log", load=[MODEL_NAME])
    try:
        triton.wait_ready(MODEL_NAME, 180)
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(triton.grpc_url)
        results: queue.Queue = queue.Queue()
        client.start_stream(lambda result, error: results.put((result, error)))
        try:
            for stream in (False, True):  # one whole answer, then the beams streamed
                outputs = [grpcclient.InferRequestedOutput(name) for name in MODEL_OUTPUTS]
                client.async_stream_infer(MODEL_NAME, triton_inputs(grpcclient, PROMPTS[:1], 2, stream=stream),
                                          outputs=outputs, request_id=f"beams-{stream}")
                responses = stream_results(results, timeout=120)
                last = {name: responses[-1].as_numpy(name) for name in MODEL_OUTPUTS}
                assert last["text_output"].shape == (1, 2) and (len(responses) > 1) == stream
                check_beams(last, 0, expected[PROMPTS[0], 2], 2, expected["eos"], with_prompt=not stream)
        finally:
            client.stop_stream()
            client.close()
    finally:
        triton.stop()
