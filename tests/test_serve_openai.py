"""The OpenAI-compatible API (/v1) of `kiln serve`, driven by the official `openai` package and raw HTTP."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest
from serve_util import CHAT_TEMPLATE, MODEL_NAME, start_server

from kiln.runtime import LLM, SamplingParams
from kiln.serve.config import ServeConfig
from kiln.serve.openai.chat import chat_template_source

PROMPT = "def add(a, b):"
PROMPTS = ["import numpy as np\n", "class Stack:\n    def push(self, item):"]
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http_base + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def llm(tiny_code_engine):
    return LLM(tiny_code_engine)


def greedy(llm, prompt, max_tokens=12):
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))[0]


def rendered_chat(llm, messages=MESSAGES) -> str:
    return llm.tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, add_generation_prompt=True,
                                             tokenize=False)


def post(server, path, body: bytes | dict, headers=None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.http_base + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_all_blocks_free(server, timeout=5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.kv_cache_stats()
        if stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == 0:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


# ---- models ------------------------------------------------------------------------------------------------
def test_models(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].owned_by == "kiln" and models[0].max_model_len == server.service.max_seq_len
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


# ---- completions -------------------------------------------------------------------------------------------
def test_completion_greedy_matches_the_runtime(client, llm):
    expected = greedy(llm, PROMPT)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL_NAME
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_prompt_forms(client, llm):
    expected = [greedy(llm, p, 8) for p in PROMPTS]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt-major
    assert [c.text for c in r.choices] == [e.text for e in expected for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)  # each prompt counted once
    assert r.usage.completion_tokens == 2 * sum(len(e.token_ids) for e in expected)
    ids = [e.prompt_token_ids for e in expected]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == [e.text for e in expected]
    one = client.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=8, temperature=0, echo=True)
    assert one.choices[0].text == llm.tokenizer.decode(ids[0]) + expected[0].text


def test_completion_n_with_seed_is_reproducible(client):
    def sample():
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, n=2, seed=7)
        return [c.text for c in r.choices]

    first = sample()
    assert first == sample()
    assert first[0] != first[1]  # choice i samples with seed + i


def test_stream_with_an_invalid_prompt_is_a_400(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        list(client.completions.create(model=MODEL_NAME, prompt=[[1, 2, 3], [1, 99999]], max_tokens=4, n=2,
                                       stream=True))
    assert e.value.body["param"] == "prompt" and "99999" in e.value.body["message"]
    stats = wait_all_blocks_free(server)
    assert stats["free_blocks"] == stats["total_blocks"]


def test_completion_logprobs(client, llm):
    expected = greedy(llm, PROMPT, 6)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(expected.token_ids)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 2  # greedy: the chosen token is the most likely one
        assert top[token] == pytest.approx(logprob) and max(top.values()) == pytest.approx(logprob)


def test_completion_stop_string(client, llm):
    full = greedy(llm, PROMPT, 16).text
    stop = full[5:8]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_completion_stream(client, llm):
    expected = greedy(llm, PROMPT)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" for c in chunks)
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(expected.token_ids)
    assert usage_chunk.usage.prompt_tokens == len(expected.prompt_token_ids)


# ---- chat ---------------------------------------------------------------------------------------------------
def test_chat_greedy_matches_the_runtime_over_the_template(client, llm):
    expected = greedy(llm, rendered_chat(llm))
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)  # the BOS token once, not twice
    assert r.usage.completion_tokens == len(expected.token_ids)
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    r = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_completion_tokens=12, temperature=0)
    assert r.choices[0].message.content == expected.text


def test_chat_stream(client, llm):
    expected = greedy(llm, rendered_chat(llm))
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    body = chunks[1:-1]
    assert "".join(c.choices[0].delta.content or "" for c in body) == expected.text
    assert body[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(expected.prompt_token_ids) + 12


def test_chat_n_with_seed_is_reproducible(client):
    def sample():
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, n=2, seed=11)
        return [c.message.content for c in r.choices]

    first = sample()
    assert first == sample() and first[0] != first[1]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert bytes(t.bytes).decode() == t.token and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy: the top one was chosen
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}


def test_the_bundled_model_chats_and_calls_tools_with_no_chat_template_flag(tiny_code_engine):
    """No --chat-template: the engine's own template (the bundled model ships one) serves chat and tools; an
    engine without one answers chat with a 400 naming the flag, and the startup line says which it is."""
    s = start_server(tiny_code_engine, chat_template=None)
    try:
        tokenizer = s.service.tokenizer
        assert chat_template_source(s.config, tokenizer) == "the engine's own (tokenizer/tokenizer_config.json)"
        client = openai.OpenAI(base_url=s.http_base + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0)
        rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        assert r.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0,
                                           tools=[WEATHER], tool_choice="required")
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        tokenizer.chat_template = None  # this server's own engine: as an engine built from a checkpoint without one
        status, body = post(s, "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES})
        assert status == 400 and "--chat-template" in body["error"]["message"]
        assert chat_template_source(s.config, tokenizer).startswith("none: /v1/chat/completions answers 400")
    finally:
        s.stop()


def test_the_startup_line_names_the_chat_template_file(tiny_code_engine):
    config = ServeConfig(engine_dir=str(tiny_code_engine), chat_template=CHAT_TEMPLATE, chat_template_file="t.jinja")
    assert chat_template_source(config, object()) == "the file given by --chat-template (t.jinja)"
    assert chat_template_source(config, None).startswith("none: this engine has no tokenizer")


# ---- errors ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 9}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": "x " * 2000}, "prompt"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"prompt": "x " * 500, "max_tokens": 600}, "prompt"),
    ({"suffix": "}"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"extra_body": {"bad_words": "def"}}, "bad_words"),
])
def test_completion_errors(client, server, kwargs, param):
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kwargs)
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    stats = wait_all_blocks_free(server)
    assert stats["free_blocks"] == stats["total_blocks"]


@pytest.mark.parametrize("kwargs, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x " * 2000}]}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_chat_errors(client, kwargs, param):
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kwargs)
    assert e.value.body["param"] == param


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert e.value.body["param"] == "model" and "gpt-4" in e.value.body["message"]


def test_malformed_json_is_a_400(server, client):
    status, body = post(server, "/v1/completions", b'{"prompt": "x", ')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = post(server, "/v1/chat/completions", b"[1, 2]")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2).choices[0].text


# ---- disconnects and keys --------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False])
def test_client_that_goes_away_frees_its_blocks(server, stream):
    body = json.dumps({"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1000 - 16, "ignore_eos": True,
                       "stream": stream, "n": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    def aborted():
        return server.service.metrics.registry.get_sample_value("kiln_requests_total", {"outcome": "abort"})

    before = aborted()
    with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=30) as sock:
        sock.sendall(head + body)
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        else:
            deadline = time.monotonic() + 10
            while server.kv_cache_stats()["num_running"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
    stats = wait_all_blocks_free(server)
    assert stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == 0
    assert aborted() == before + 2


def test_api_key(tiny_code_engine):
    s = start_server(tiny_code_engine, api_key="secret")
    try:
        wrong = openai.OpenAI(base_url=s.http_base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=s.http_base + "/v1", api_key="secret", max_retries=0)
        assert right.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    finally:
        s.stop()
