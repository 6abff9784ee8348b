"""Context and generation logits and perf metrics (issue 35, item 2; TensorRT-LLM's return_context_logits,
return_generation_logits, return_perf_metrics) on the bundled kiln-tiny-code in float32: the logits equal
transformers' forward pass within float32 tolerance, in one step or chunked (a small max_num_tokens), under
preemption and beside requests that ask for nothing (whose outputs stay what they are alone); beam search gives
each beam its own [len, vocab]. The Triton doors (tritonclient HTTP and gRPC) are tested at the end."""

from __future__ import annotations

import pytest
import torch
from serve_util import EXAMPLES, MODEL_NAME, infer_inputs, stream_results

from kiln.runtime import LLM, SamplingParams

CHECKPOINT = EXAMPLES / "kiln-tiny-code"
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):\n        self.items.append(item)\n    def",
           "import os\nimport sys\n\n\ndef main():\n    path = sys.argv[1]\n    for name in os.listdir(path):"]
ATOL = 2e-4
BOTH = dict(return_context_logits=True, return_generation_logits=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """kiln-tiny-code in float32 with --max-beam-width 2."""
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    return build_engine(CHECKPOINT, tmp_path_factory.mktemp("logits") / "engine",
                        BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=256, max_beam_width=2),
                        progress=False)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(engine):
    llm = LLM(engine)
    yield llm
    llm.shutdown()


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] float32: transformers' logits at every position of `token_ids`."""
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def check_against_hf(hf, out, max_tokens: int) -> None:
    prompt, generated = list(out.prompt_token_ids), list(out.token_ids)
    reference = hf_logits(hf, prompt + generated)  # [P + L, V]
    assert out.context_logits.dtype == torch.float32 and out.context_logits.shape == (len(prompt), reference.shape[1])
    torch.testing.assert_close(out.context_logits, reference[:len(prompt)], atol=ATOL, rtol=0)
    assert out.generation_logits.shape == (len(generated), reference.shape[1]) and len(generated) == max_tokens
    torch.testing.assert_close(out.generation_logits, reference[len(prompt) - 1:-1], atol=ATOL, rtol=0)
    assert out.outputs[0].generation_logits is out.generation_logits


def test_logits_equal_transformers(llm, hf):
    for out in llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, **BOTH)):
        check_against_hf(hf, out, 6)


def test_logits_are_raw_and_others_unchanged(llm, hf):
    """Generation logits are the model's, before temperature and penalties; requests that ask for nothing get
    what they get alone, and none of the extra outputs."""
    plain = SamplingParams(max_tokens=8, temperature=0, logprobs=True)
    alone = llm.generate(PROMPTS, plain)
    sampled = SamplingParams(max_tokens=5, temperature=0.7, repetition_penalty=1.3, seed=3, **BOTH)
    mixed = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2]], [plain, sampled, plain, plain])
    for got, want in zip([mixed[0], mixed[2], mixed[3]], [alone[0], alone[0], alone[2]]):
        assert got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert got.context_logits is None and got.generation_logits is None and got.perf_metrics is None
    check_against_hf(hf, mixed[1], 5)


def test_chunked_prefill_and_preemption_give_the_same_logits(engine, hf):
    """Prompts computed in chunks of at most 8 tokens, in a cache too small for all of them at once."""
    llm = LLM(engine, num_kv_blocks=6, max_num_tokens=8)
    try:
        outs = llm.generate(PROMPTS * 2, SamplingParams(max_tokens=16, temperature=0, **BOTH))
        assert llm.kv_cache_stats()["num_preemptions"] > 0
        for out in outs:
            check_against_hf(hf, out, 16)
    finally:
        llm.shutdown()


def test_prefix_cache_does_not_hide_context_logits(llm, hf):
    """A cached prompt is computed again for a request that wants its context logits."""
    llm.generate(PROMPTS[2], SamplingParams(max_tokens=2, temperature=0))
    out, = llm.generate(PROMPTS[2], SamplingParams(max_tokens=2, temperature=0, return_perf_metrics=True, **BOTH))
    assert out.num_cached_tokens == 0 and out.perf_metrics.kv_cache_reused_blocks == 0
    check_against_hf(hf, out, 2)
    again, = llm.generate(PROMPTS[2], SamplingParams(max_tokens=2, temperature=0, return_perf_metrics=True))
    assert again.num_cached_tokens > 0 and again.perf_metrics.kv_cache_reused_blocks > 0


def test_delta_updates_split_the_logits(llm, hf):
    """output_kind "delta": the context logits come in the first update, each update has its tokens' rows."""
    engine = llm.engine
    request_id = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, output_kind="delta",
                                                               **BOTH))
    updates = []
    while engine.has_unfinished():
        updates += [o for o in engine.step() if o.request_id == request_id]
    assert updates[0].context_logits is not None and all(u.context_logits is None for u in updates[1:])
    assert all(len(u.generation_logits) == len(u.token_ids) for u in updates)
    rows = torch.cat([u.generation_logits for u in updates if u.token_ids])
    ids = [t for u in updates for t in u.token_ids]
    reference = hf_logits(hf, list(updates[0].prompt_token_ids) + ids)
    torch.testing.assert_close(rows, reference[len(updates[0].prompt_token_ids) - 1:-1], atol=ATOL, rtol=0)


def test_beam_search_generation_logits(llm, hf):
    """Each beam's generation logits are those of its own tokens (whichever beams they were chosen on)."""
    out, = llm.generate(PROMPTS[1], SamplingParams(max_tokens=6, n=2, use_beam_search=True, temperature=0, **BOTH))
    prompt = list(out.prompt_token_ids)
    torch.testing.assert_close(out.context_logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)
    assert len(out.outputs) == 2
    for beam in out.outputs:
        reference = hf_logits(hf, prompt + list(beam.token_ids))
        assert beam.generation_logits.shape == (len(beam.token_ids), reference.shape[1])
        torch.testing.assert_close(beam.generation_logits, reference[len(prompt) - 1:-1], atol=ATOL, rtol=0)


def test_speculative_decoding_keeps_the_rows_of_the_tokens_it_keeps(engine, hf):
    """With n-gram drafts a step verifies several rows of a request: each kept token gets its own row, and the
    perf metrics count the drafts."""
    prompt = "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw = [1, 2"
    with LLM(engine, speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        out, = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, return_perf_metrics=True, **BOTH))
        assert llm.speculation_stats()["num_accepted_tokens"] > 0
    check_against_hf(hf, out, 12)
    m = out.perf_metrics
    assert m.total_draft_tokens >= m.total_accepted_draft_tokens > 0
    assert m.acceptance_rate == m.total_accepted_draft_tokens / m.total_draft_tokens


def test_perf_metrics_are_ordered(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, return_perf_metrics=True))
    beam, = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, n=2, use_beam_search=True, temperature=0,
                                                    return_perf_metrics=True))
    for out in [*outs, beam]:
        m = out.perf_metrics
        assert m.arrival_time_ns <= m.first_scheduled_time_ns <= m.first_token_time_ns <= m.last_token_time_ns
        assert m.kv_cache_alloc_total_blocks == m.kv_cache_reused_blocks + m.kv_cache_alloc_new_blocks >= 1
        assert m.total_draft_tokens == 0 and m.acceptance_rate == 0.0


@pytest.mark.parametrize("field", ["return_context_logits", "return_generation_logits", "return_perf_metrics"])
def test_flags_must_be_bools(field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}=1 is invalid"):
        SamplingParams(**{field: 1})


# ---- the Triton doors: tritonclient over HTTP and gRPC, the generate extension, the repository's model.py ----
EXTRA = ("context_logits", "generation_logits", "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
         "last_token_time_ns", "kv_cache_reused_blocks", "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks",
         "acceptance_rate", "total_draft_tokens", "total_accepted_draft_tokens")
FLAGS = dict(return_context_logits=True, return_generation_logits=True, return_perf_metrics=True)


@pytest.fixture(scope="module")
def server(engine):
    from serve_util import start_server

    srv = start_server(engine)
    yield srv
    srv.stop()


def triton_inputs(module, prompts, asks, **scalars):
    """One row per prompt; `asks[i]`: whether row i asks for the logits and perf metrics."""
    import numpy as np

    from kiln.serve.tritonserver.schema import DATATYPES, INPUT_SPECS

    arrays = {"text_input": np.array([[p.encode()] for p in prompts], dtype=np.object_),
              "max_tokens": np.array([[5]] * len(prompts), dtype=np.int32)}
    for name in FLAGS:
        arrays[name] = np.array([[a] for a in asks], dtype=bool)
    for name, value in scalars.items():
        arrays[name] = np.array([[value]] * len(prompts), dtype=DATATYPES[INPUT_SPECS[name].datatype][1])
    return infer_inputs(module, arrays)


def check_triton_row(result, row: int, out, hf, width: int = 1) -> None:
    """Row `row` of Triton outputs against `out` (LLM.generate's RequestOutput) and transformers' logits."""
    import numpy as np

    prompt = list(out.prompt_token_ids)
    context = result["context_logits"][row]
    np.testing.assert_allclose(context[:len(prompt)], hf_logits(hf, prompt).numpy(), atol=ATOL, rtol=0)
    assert not context[len(prompt):].any()  # padding to the longest prompt of the batch
    for j, beam in enumerate(out.outputs[:width]):
        reference = hf_logits(hf, prompt + list(beam.token_ids))[len(prompt) - 1:-1].numpy()
        np.testing.assert_allclose(result["generation_logits"][row, j, :len(beam.token_ids)], reference, atol=ATOL,
                                   rtol=0)
    times = [int(result[name][row, 0]) for name in ("arrival_time_ns", "first_scheduled_time_ns",
                                                     "first_token_time_ns", "last_token_time_ns")]
    assert 0 < times[0] <= times[1] <= times[2] <= times[3]
    assert result["kv_cache_alloc_total_blocks"][row, 0] >= 1


def test_tritonclient_http_and_grpc(server, llm, hf):
    """Both rows computed in one batch, the second asking for nothing (its outputs are zeros); shapes and types as
    TensorRT-LLM's: [batch, prompt_len, vocab] and [batch, beam, len, vocab] FP32, [batch, 1] metrics."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from kiln.serve.tritonserver.schema import OUTPUT_SPECS

    want = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=5, temperature=0))
    http = httpclient.InferenceServerClient(server.http_url)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for module, client in ((httpclient, http), (grpcclient, grpc)):
            outputs = [module.InferRequestedOutput(name) for name in ("text_output", *EXTRA)]
            got = client.infer(MODEL_NAME, triton_inputs(module, PROMPTS[:2], [True, False]), outputs=outputs)
            result = {name: got.as_numpy(name) for name in EXTRA}
            # padded to the longest of the rows that asked
            assert result["context_logits"].shape == (2, len(want[0].prompt_token_ids), 8192)
            assert result["generation_logits"].shape == (2, 1, 5, 8192)
            for name in EXTRA:
                assert result[name].dtype == np.dtype({"FP32": np.float32, "INT32": np.int32, "INT64": np.int64}[
                    OUTPUT_SPECS[name].datatype]), name
                assert not result[name][1].any(), name  # the row that did not ask
            check_triton_row(result, 0, want[0], hf)
            # outputs not named: those the request asked for come back
            got = client.infer(MODEL_NAME, triton_inputs(module, PROMPTS[:1], [True]))
            assert got.as_numpy("context_logits").shape[1] == len(want[0].prompt_token_ids)
            assert got.as_numpy("arrival_time_ns").shape == (1, 1)
    finally:
        http.close()
        grpc.close()


def test_tritonclient_beam_generation_logits(server, llm, hf):
    import tritonclient.http as httpclient

    want, = llm.generate(PROMPTS[1], SamplingParams(max_tokens=5, n=2, use_beam_search=True, temperature=0))
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        outputs = [httpclient.InferRequestedOutput(name) for name in EXTRA]
        got = client.infer(MODEL_NAME, triton_inputs(httpclient, PROMPTS[1:2], [True], beam_width=2), outputs=outputs)
    finally:
        client.close()
    result = {name: got.as_numpy(name) for name in EXTRA}
    assert result["generation_logits"].shape[:2] == (1, 2)
    check_triton_row(result, 0, want, hf, width=2)


def test_generate_extension_fields(server, llm, hf):
    import json

    from serve_util import post_json

    want, = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
    status, text = post_json(server, f"/v2/models/{MODEL_NAME}/generate",
                             {"text_input": PROMPTS[0], "max_tokens": 5, **FLAGS})
    assert status == 200, text
    body = json.loads(text)
    prompt = list(want.prompt_token_ids)
    reference = hf_logits(hf, prompt + list(want.token_ids))
    torch.testing.assert_close(torch.tensor(body["context_logits"]), reference[:len(prompt)], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor(body["generation_logits"]), reference[len(prompt) - 1:-1], atol=ATOL,
                               rtol=0)
    assert body["arrival_time_ns"] <= body["first_token_time_ns"] <= body["last_token_time_ns"]


def test_the_triton_model_returns_logits(engine, llm, hf, tmp_path):
    """The repository's model.py, run as Triton's Python backend runs it (tests/triton_stub's stand-in)."""
    import sys
    from pathlib import Path

    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent / "triton_stub"))
    import triton_python_backend_utils as pb
    from test_triton_repo import execute, load_model, outputs_of, wait_for

    from kiln.cli import main

    want, = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
    assert main(["triton-repo", "--engine", str(engine), "--output", str(tmp_path / "models")]) == 0
    model = load_model(tmp_path / "models" / engine.name)
    try:
        tensors = [pb.Tensor("text_input", np.array([[PROMPTS[0].encode()]], dtype=np.object_)),
                   pb.Tensor("max_tokens", np.array([[5]], dtype=np.int32))]
        tensors += [pb.Tensor(name, np.array([[True]])) for name in FLAGS]
        request = pb.InferenceRequest(tensors, ["text_output", *EXTRA])
        execute(model, request)
        wait_for(lambda: request.sender.finished)
        check_triton_row(outputs_of(request.sender.responses[0]), 0, want, hf)
    finally:
        model.finalize()


def test_grpc_stream_splits_the_logits(server, llm, hf):
    """stream=true: the first response carries the context logits, each its new tokens' generation logits."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    want, = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        outputs = [grpcclient.InferRequestedOutput(name) for name in ("output_ids", *EXTRA)]
        client.async_stream_infer(MODEL_NAME, triton_inputs(grpcclient, PROMPTS[:1], [True], stream=True),
                                  outputs=outputs)
        results = stream_results(responses)
    finally:
        client.stop_stream()
        client.close()
    prompt, generated = list(want.prompt_token_ids), list(want.token_ids)
    reference = hf_logits(hf, prompt + generated)
    first = results[0].as_numpy("context_logits")[0]
    np.testing.assert_allclose(first, reference[:len(prompt)].numpy(), atol=ATOL, rtol=0)
    assert all(r.as_numpy("context_logits").size == 0 for r in results[1:])
    rows = np.concatenate([r.as_numpy("generation_logits")[0, 0] for r in results
                           if r.as_numpy("generation_logits").size])
    ids = [int(t) for r in results for t in r.as_numpy("output_ids")[0, 0]]
    assert ids == generated[:len(ids)] and len(rows) == len(ids)
    np.testing.assert_allclose(rows, reference[len(prompt) - 1:len(prompt) - 1 + len(ids)].numpy(), atol=ATOL,
                               rtol=0)
    last = results[-1]
    assert last.as_numpy("last_token_time_ns")[0, 0] >= last.as_numpy("first_token_time_ns")[0, 0] > 0
