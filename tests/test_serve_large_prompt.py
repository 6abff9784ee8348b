"""`kiln serve` and huge prompts (kiln issue 31, finding 3): a 7.8 MB text_input was tokenized on the engine thread
(every stream froze for 70 s, RSS peaked at 4.9 GB and stayed there) and OpenAI prompts on the event loop
(/health took 15 s). Now a prompt over --max-prompt-chars is a 400 before anything is tokenized, on every API;
tokenizing, chat templating and large decoding run on the EngineService's prompt worker, never on the event loop
or the engine thread; and memory goes back to the system after a large prompt. Against a real server."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from serve_util import MODEL_NAME, counters, message, start_server
from tritonclient.utils import InferenceServerException

from kiln.cli import main
from kiln.runtime import SamplingParams
from kiln.serve.config import ServeConfig
from kiln.serve.limits import default_max_prompt_chars
from kiln.serve.tritonserver.repository import BackendParameters

PROMPT = "def add(a, b):"
GENERATE = f"/v2/models/{MODEL_NAME}/generate"
GENERATE_STREAM = f"/v2/models/{MODEL_NAME}/generate_stream"
INFER = f"/v2/models/{MODEL_NAME}/infer"
HUGE = ("x = 1; " * 1_200_000)[:7_800_000]  # 7.8 MB, the tester's text_input (no JSON escapes)
CODE = "def add(a, b):\n    return a + b\n\n"


# ---- helpers ---------------------------------------------------------------------------------------------
def post(server, path: str, body: dict | bytes, timeout: float = 120) -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.http_base + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def infer_body(prompts: list[str]) -> dict:
    rows = len(prompts)
    return {"inputs": [{"name": "text_input", "shape": [rows, 1], "datatype": "BYTES", "data": prompts},
                       {"name": "max_tokens", "shape": [rows, 1], "datatype": "INT32", "data": [2] * rows}]}


def grpc_infer(server, prompt: str) -> tuple[str, dict]:
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
    tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    tokens.set_data_from_numpy(np.full((1, 1), 2, dtype=np.int32))
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.infer(MODEL_NAME, [text, tokens], client_timeout=120)
        return "StatusCode.OK", {"error": ""}
    except InferenceServerException as e:
        return e.status(), {"error": e.message()}
    finally:
        client.close()


def rss_mib(key: str = "VmRSS") -> float:
    """This process's (the in-process server's) resident memory, or its peak with key VmHWM, in MiB."""
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {key} in /proc/self/status")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class StreamWatch:
    """Keeps one OpenAI completion streaming at a time, back to back, and polls /v2/health/ready, until stopped;
    records the worst gap between two chunks of a stream and the worst health-check latency."""

    def __init__(self, server) -> None:
        self.server = server
        self.worst_gap = self.worst_health = 0.0
        self.chunks = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._stream, daemon=True),
                         threading.Thread(target=self._health, daemon=True)]
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + 30
        while self.chunks < 3 and not self.errors:  # streaming before the large prompt comes
            assert time.monotonic() < deadline, "the watched stream never started"
            time.sleep(0.01)

    def _stream(self) -> None:
        try:
            self._streams()
        except BaseException as e:  # the test asserts there were none
            self.errors.append(e)

    def _streams(self) -> None:
        host, port = self.server.http_url.split(":")
        body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True,
                           "temperature": 0}).encode()
        while not self._stop.is_set():
            connection = http.client.HTTPConnection(host, int(port), timeout=30)
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            assert response.status == 200
            last = None
            while line := response.readline():
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    self.worst_gap = max(self.worst_gap, now - last)
                last = now
                self.chunks += 1
            connection.close()

    def _health(self) -> None:
        try:
            self._health_checks()
        except BaseException as e:
            self.errors.append(e)

    def _health_checks(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            with urllib.request.urlopen(self.server.http_base + "/v2/health/ready", timeout=30) as response:
                assert response.status == 200
            self.worst_health = max(self.worst_health, time.perf_counter() - start)
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        assert not self.errors, self.errors


@pytest.fixture(scope="module")
def roomy(tiny_code_engine):
    """A server whose character cap (3 MB) lets a large prompt through to the tokenizer."""
    srv = start_server(tiny_code_engine, max_prompt_chars=3_000_000)
    yield srv
    srv.stop()


# ---- the limit -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_config_rejects_a_cap_that_is_not_a_positive_integer(value):
    with pytest.raises(ValueError, match="ServeConfig.max_prompt_chars="):
        ServeConfig(engine_dir="e", max_prompt_chars=value)


def test_the_default_cap_is_a_million_or_8_characters_a_token():
    assert ServeConfig(engine_dir="e").max_prompt_chars is None
    assert default_max_prompt_chars(1024) == 1_000_000
    assert default_max_prompt_chars(1_000_000) == 8_000_000


def test_cli_flag_reaches_the_config(monkeypatch, tmp_path):
    seen = []

    async def fake_serve(config):
        seen.append(config)

    monkeypatch.setattr("kiln.serve.server.serve", fake_serve)
    assert main(["serve", "--engine", str(tmp_path), "--max-prompt-chars", "1234"]) == 0
    assert main(["serve", "--engine", str(tmp_path)]) == 0
    assert [config.max_prompt_chars for config in seen] == [1234, None]
    assert main(["serve", "--engine", str(tmp_path), "--max-prompt-chars", "0"]) == 2  # refused, naming the flag


EXPECTED = "has 7800000 characters; this server takes at most 1000000 per prompt, checked before tokenizing " \
           "(--max-prompt-chars)"
OVER_THE_CAP = [
    ("/v1/completions", {"prompt": HUGE, "max_tokens": 2}, f"prompt {EXPECTED}"),
    ("/v1/completions", {"prompt": [PROMPT, HUGE], "max_tokens": 2}, f"prompt 1 {EXPECTED}"),
    # two messages under the cap each, over it together
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE[:600_000]},
                                           {"role": "user", "content": HUGE[:600_000]}], "max_tokens": 2},
     "the messages' content has 1200000 characters; this server takes at most 1000000 per prompt"),
    (GENERATE, {"text_input": HUGE, "max_tokens": 2}, f"input 'text_input' {EXPECTED}"),
    (GENERATE_STREAM, {"text_input": HUGE, "max_tokens": 2}, f"input 'text_input' {EXPECTED}"),
    (INFER, infer_body([HUGE]), f"input 'text_input' {EXPECTED}"),
    (INFER, infer_body([PROMPT, HUGE]), f"batch row 1: input 'text_input' {EXPECTED}"),
    ("/tokenize", {"prompt": HUGE}, f"prompt {EXPECTED}"),
    ("/tokenize", {"messages": [{"role": "user", "content": HUGE}]}, "the messages' content has 7800000 characters"),
]


@pytest.mark.parametrize("path, body, expected", OVER_THE_CAP,
                         ids=[f"{p.rsplit('/', 1)[1]}-{i}" for i, (p, _, _) in enumerate(OVER_THE_CAP)])
def test_a_prompt_over_the_cap_is_refused_at_once(server, path, body, expected):
    data = json.dumps(body).encode()
    before = counters(server)
    start = time.perf_counter()
    status, response = post(server, path, data)
    elapsed = time.perf_counter() - start
    assert status == 400 and expected in message(response), response
    assert elapsed < 1.0, f"the 400 took {elapsed:.2f} s"
    assert counters(server) == before  # no engine request, no prompt token counted


def test_a_prompt_over_the_cap_is_refused_at_once_over_grpc(server):
    start = time.perf_counter()
    status, response = grpc_infer(server, HUGE)
    elapsed = time.perf_counter() - start
    assert status == "StatusCode.INVALID_ARGUMENT" and f"input 'text_input' {EXPECTED}" in response["error"]
    assert elapsed < 1.0, f"the error took {elapsed:.2f} s"


# ---- off the event loop and the engine thread --------------------------------------------------------------
def test_no_text_is_tokenized_or_templated_on_the_event_loop_or_the_engine_thread(server, monkeypatch):
    tokenizer = server.service.tokenizer
    threads: list[tuple[str, str]] = []

    def recorded(name, fn):
        def call(*args, **kwargs):
            threads.append((name, threading.current_thread().name))
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(tokenizer, "encode", recorded("encode", tokenizer.encode))
    monkeypatch.setattr(tokenizer, "apply_chat_template", recorded("template", tokenizer.apply_chat_template))
    assert post(server, "/v1/completions", {"prompt": [PROMPT, "import os"], "max_tokens": 2})[0] == 200
    assert post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2})[0] == 200
    assert post(server, GENERATE, {"text_input": PROMPT, "max_tokens": 2})[0] == 200
    assert post(server, GENERATE_STREAM, {"text_input": PROMPT, "max_tokens": 2})[0] == 200
    assert post(server, INFER, infer_body([PROMPT, "import os"]))[0] == 200
    assert grpc_infer(server, PROMPT)[0] == "StatusCode.OK"
    assert post(server, "/tokenize", {"prompt": PROMPT})[0] == 200
    assert post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})[0] == 200

    async def direct() -> None:  # AsyncLLM from Python with a text prompt
        async for _ in server.service.llm.generate(PROMPT, SamplingParams(max_tokens=2), request_id="direct"):
            pass

    server.call(direct())
    assert len(threads) >= 12, threads
    assert all(name.startswith(("kiln-prompt", "asyncio")) for _, name in threads), threads


LARGE = (CODE * 50_000)[:1_500_000]  # 1.5 MB of code: 636k tokens, refused for max_seq_len 1024 once tokenized
LARGE_REQUESTS = [
    (GENERATE, {"text_input": LARGE, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LARGE}], "max_tokens": 2}),
]


@pytest.mark.slow
@pytest.mark.parametrize("path, body", LARGE_REQUESTS, ids=["generate", "chat"])
def test_a_large_prompt_does_not_stall_other_streams_and_its_memory_is_given_back(roomy, path, body):
    data = json.dumps(body).encode()
    post(roomy, GENERATE, {"text_input": PROMPT, "max_tokens": 2})  # warm
    watch = StreamWatch(roomy)
    try:
        reset_peak_rss()
        rss_before = rss_mib()
        start = time.perf_counter()
        status, response = post(roomy, path, data)
        to_400 = time.perf_counter() - start
        rss_peak = rss_mib("VmHWM")
        time.sleep(0.2)  # the stream goes on after the 400
    finally:
        watch.stop()
    rss_after = rss_mib()
    print(f"\n1.5 MB prompt on {path}: 400 after {to_400:.2f} s; worst stream gap {watch.worst_gap * 1000:.0f} ms "
          f"over {watch.chunks} chunks; worst /v2/health/ready {watch.worst_health * 1000:.0f} ms; RSS before "
          f"{rss_before:.0f} MiB, peak {rss_peak:.0f} MiB, after {rss_after:.0f} MiB")
    assert status == 400 and "exceeds max_seq_len 1024" in message(response), response
    # The goal is 0.5 s (it took 70 s on the engine thread); a CPU shared with other work adds scheduling delays.
    assert watch.worst_gap < 1.0 and watch.worst_health < 1.0
    # Without malloc_trim the tokenizer's freed memory stays: about +290 MiB after 2 MB, +850 MiB after 7.8 MB.
    assert rss_after - rss_before < 100, (rss_before, rss_peak, rss_after)


# ---- the Triton model of `kiln triton-repo` ------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-5", "many"])
def test_the_triton_models_cap_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="max_prompt_chars="):
        BackendParameters.from_strings({"engine_dir": "/engine", "max_prompt_chars": value})


def test_the_triton_model_refuses_a_prompt_over_its_cap_and_tokenizes_off_its_engine_thread(tiny_code_engine,
                                                                                             tmp_path):
    from test_triton_repo import error_of, execute, load_model, make_request, read_config

    repo = tmp_path / "models"
    assert main(["triton-repo", "--engine", str(tiny_code_engine), "--output", str(repo)]) == 0

    def with_cap(model_dir):
        config = read_config(model_dir)
        config.parameters["max_prompt_chars"].string_value = "1000"
        return config

    model = load_model(repo / tiny_code_engine.name, parse_config=with_cap)
    try:
        tokenizer = model.llm.tokenizer
        threads = []
        encode = tokenizer.encode
        tokenizer.encode = lambda *a, **k: threads.append(threading.current_thread().name) or encode(*a, **k)
        over, good = make_request(["x" * 1001]), make_request([PROMPT], max_tokens=2)
        start = time.perf_counter()
        execute(model, over, good)
        assert error_of(over) == ("input 'text_input' has 1001 characters; this server takes at most 1000 per "
                                  "prompt, checked before tokenizing (config.pbtxt parameter max_prompt_chars)")
        assert time.perf_counter() - start < 1.0
        assert good.sender.wait_final(60) and not good.sender.responses[0].has_error()
        assert threads and "kiln-triton-engine" not in threads, threads
    finally:
        del tokenizer.encode
        model.finalize()
