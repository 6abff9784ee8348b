"""What tools written for vLLM send to `kiln serve`, over plain HTTP: completions' echo with logprobs (lm-eval's
loglikelihood request) and max_tokens 0, vLLM's extra sampling fields, and the routes /health, /version,
/metrics, /tokenize and /detokenize. Values are checked against kiln.runtime.LLM on the same engine, whose prompt
top-k logprobs are checked against Hugging Face transformers."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import pytest
import torch
from serve_util import CHAT_TEMPLATE, EXAMPLES, MODEL_NAME, start_server

import kiln
from kiln.runtime import LLM, SamplingParams

PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def llm(tiny_code_engine):
    return LLM(tiny_code_engine)


def request(server, method: str, path: str, body: dict | None = None, headers=None) -> tuple[int, object, str]:
    """-> (status, parsed JSON or None, raw text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.http_base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            status, raw = response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw), raw
    except ValueError:
        return status, None, raw


def post(server, path, body, **kwargs):
    status, data, _ = request(server, "POST", path, body, **kwargs)
    return status, data


def stream_events(server, body: dict) -> list[dict]:
    req = urllib.request.Request(server.http_base + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=60) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


# ---- the runtime: prompt top-k logprobs and min_tokens -------------------------------------------------------
def test_prompt_top_logprobs_are_the_reference_distributions_top_k(llm):
    from transformers import AutoModelForCausalLM

    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True,
                                              prompt_top_logprobs=3))[0]
    hf = AutoModelForCausalLM.from_pretrained(EXAMPLES / "kiln-tiny-code", dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([out.prompt_token_ids])).logits[0].float(), dim=-1)
    n = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    assert len(out.prompt_top_logprobs) == n
    for i in range(1, n):
        values, ids = ref[i - 1].topk(3)
        top = out.prompt_top_logprobs[i]
        assert list(top) == ids.tolist()  # most likely first
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
        assert out.prompt_logprobs[i] == pytest.approx(ref[i - 1, out.prompt_token_ids[i]].item(), abs=1e-4)
    # prompt_logprobs=True alone is as before: no top tokens
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True))[0]
    assert plain.prompt_top_logprobs is None and plain.prompt_logprobs == pytest.approx(out.prompt_logprobs)


def test_sampling_params_check_the_new_fields():
    for kwargs, name in [({"prompt_top_logprobs": 2}, "prompt_top_logprobs"),
                         ({"prompt_logprobs": True, "prompt_top_logprobs": 21}, "prompt_top_logprobs"),
                         ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
                         ({"skip_special_tokens": 1}, "skip_special_tokens")]:
        with pytest.raises(ValueError, match=f"SamplingParams.{name}="):
            SamplingParams(**kwargs)


def test_min_tokens_keeps_going_past_a_stop_token(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    first = greedy[0]
    stopped = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[first]))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[first], min_tokens=4,
                                               ignore_eos=True))[0]
    # As in vLLM, the stop id cannot be sampled before min_tokens: the next most likely token is taken.
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]
    assert first not in held.token_ids[4:-1]  # once past min_tokens, the stop id ends it again


# ---- echo with logprobs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 3])
def test_echo_logprobs_match_the_runtime(server, llm, k):
    ids = llm.engine.tokenize(PROMPT)
    expected = llm.generate(ids, SamplingParams(max_tokens=4, temperature=0, logprobs=True, top_logprobs=k,
                                                prompt_logprobs=True, prompt_top_logprobs=k))[0]
    status, r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0, "echo": True,
                                                  "logprobs": k})
    assert status == 200, r
    choice = r["choices"][0]
    lp = choice["logprobs"]
    n = len(ids)
    all_ids = ids + expected.token_ids
    assert lp["tokens"] == [llm.tokenizer.decode([t]) for t in all_ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(expected.prompt_logprobs[1:] + expected.logprobs, abs=1e-5)
    tops = expected.prompt_top_logprobs or [None] * n
    for i in range(1, len(all_ids)):
        top = lp["top_logprobs"][i]
        alternatives = tops[i] if i < n else (expected.top_logprobs[i - n] if k else {})
        wanted = {llm.tokenizer.decode([t]): v for t, v in (alternatives or {}).items()}
        wanted.setdefault(lp["tokens"][i], lp["token_logprobs"][i])
        assert top.keys() == wanted.keys()
        assert list(top.values()) == pytest.approx(list(wanted.values()), abs=1e-5)
    # text: the detokenized prompt, then the completion; offsets run over the token strings
    assert choice["text"] == llm.tokenizer.decode(ids) + expected.text
    assert choice["text"].startswith("".join(lp["tokens"][:n]))
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(all_ids))]
    assert lp["text_offset"] == offsets
    assert r["usage"] == {"prompt_tokens": n, "completion_tokens": 4, "total_tokens": n + 4,
                          "prompt_tokens_details": {"cached_tokens": 0}}  # echo + prompt logprobs: all computed


def test_echo_logprobs_of_a_text_prompt_and_is_greedy(server, llm):
    """lm-eval's loglikelihood request: top-1 decides whether the continuation is greedy."""
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True,
                                                   prompt_top_logprobs=1))[0]
    status, r = post(server, "/v1/completions", {"prompt": [PROMPT], "max_tokens": 1, "temperature": 0,
                                                  "echo": True, "logprobs": 1, "seed": 1234})
    assert status == 200, r
    lp = r["choices"][0]["logprobs"]
    n = len(expected.prompt_token_ids)
    assert r["choices"][0]["text"].startswith(PROMPT)
    assert len(lp["token_logprobs"]) == n + 1
    for i in range(1, n):
        is_top = expected.prompt_token_ids[i] == next(iter(expected.prompt_top_logprobs[i]))
        assert (lp["token_logprobs"][i] == max(lp["top_logprobs"][i].values())) == is_top


def test_echo_with_max_tokens_0_generates_nothing(server, llm):
    ids = llm.engine.tokenize(PROMPT)
    expected = llm.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True))[0]
    body = {"prompt": [ids, ids[:4]], "max_tokens": 0, "echo": True, "logprobs": 0}
    status, r = post(server, "/v1/completions", body)
    assert status == 200, r
    first = r["choices"][0]
    assert first["text"] == llm.tokenizer.decode(ids) and first["finish_reason"] == "length"
    assert first["logprobs"]["tokens"] == [llm.tokenizer.decode([t]) for t in ids]
    assert first["logprobs"]["token_logprobs"][1:] == pytest.approx(expected.prompt_logprobs[1:], abs=1e-5)
    assert len(r["choices"][1]["logprobs"]["tokens"]) == 4
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == len(ids) + 4
    status, r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True})
    assert status == 200 and r["choices"][0]["text"] == PROMPT and r["choices"][0]["logprobs"] is None
    # streamed: the same text and logprobs, in pieces
    events = stream_events(server, body)
    for index, whole in enumerate(post(server, "/v1/completions", body)[1]["choices"]):
        pieces = [c for e in events for c in e["choices"] if c["index"] == index]
        assert "".join(p["text"] for p in pieces) == whole["text"]
        assert [t for p in pieces for t in p["logprobs"]["tokens"]] == whole["logprobs"]["tokens"]
        assert pieces[-1]["finish_reason"] == "length"


def test_streamed_echo_logprobs_equal_the_whole_answer(server):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 2, "ignore_eos": True}
    whole = post(server, "/v1/completions", body)[1]["choices"][0]
    pieces = [c for e in stream_events(server, body) for c in e["choices"]]
    assert "".join(p["text"] for p in pieces) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for p in pieces for v in p["logprobs"][key]] == whole["logprobs"][key]


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),  # only with echo
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"echo": True, "logprobs": 6}, "logprobs"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"bad_words": [""]}, "bad_words"),
])
def test_bad_fields_are_400s_naming_them(server, body, param):
    status, r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **body})
    assert status == 400 and r["error"]["param"] == param, r


def test_a_prompt_that_fills_max_seq_len_with_max_tokens_0(server):
    ids = [5] * server.service.max_seq_len
    status, r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True})
    assert status == 400 and r["error"]["param"] == "prompt" and "max_tokens=0" in r["error"]["message"]


# ---- vLLM's sampling fields --------------------------------------------------------------------------------
@pytest.mark.parametrize("fields", [
    {"top_k": 1, "temperature": 1.0},
    {"min_p": 0.2, "seed": 3},
    {"repetition_penalty": 1.3, "temperature": 0},
    {"min_tokens": 6, "temperature": 0},
    {"ignore_eos": True, "temperature": 0, "skip_special_tokens": False},
])
def test_vllm_sampling_fields_match_the_runtime(server, llm, fields):
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=12, **fields))[0]
    status, r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, **fields})
    assert status == 200, r
    assert r["choices"][0]["text"] == expected.text
    assert r["usage"]["completion_tokens"] == len(expected.token_ids)


def test_eos_with_min_tokens_and_skip_special_tokens(server, llm):
    """After this prompt the model's greedy choice is EOS at once."""
    prompt = 'if __name__ == "__main__":\n    main()\n'
    eos = llm.tokenizer.eos_token

    def complete(**fields):
        status, r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0, **fields})
        assert status == 200, r
        return r["choices"][0], r["usage"]["completion_tokens"]

    assert complete() == ({"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}, 1)
    choice, tokens = complete(min_tokens=3)  # EOS cannot be sampled before 3 tokens
    assert tokens >= 3 and eos not in choice["text"]
    choice, _ = complete(min_tokens=3, skip_special_tokens=False)
    assert not choice["text"].startswith(eos)
    choice, _ = complete(ignore_eos=True, skip_special_tokens=False)
    assert choice["text"].startswith(eos) and choice["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(server, llm, stream):
    text = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
    stop = text.strip()[:2]
    cut = text[:text.index(stop)]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": ["never seen", stop]}
    for keep, expected in [(False, cut), (True, cut + stop)]:
        body["include_stop_str_in_output"] = keep
        if stream:
            got = "".join(c["text"] for e in stream_events(server, body) for c in e["choices"])
        else:
            got = post(server, "/v1/completions", body)[1]["choices"][0]["text"]
        assert got == expected
    status, r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 12, "temperature": 0, "stop": ["e"],
                                                       "include_stop_str_in_output": True})
    content = r["choices"][0]["message"]["content"]
    assert status == 200 and (r["choices"][0]["finish_reason"] != "stop" or content.endswith("e"))


# ---- routes -------------------------------------------------------------------------------------------------
def test_health_version_metrics(server):
    status, _, raw = request(server, "GET", "/health")
    assert status == 200 and raw == ""
    assert request(server, "GET", "/version")[1] == {"version": kiln.__version__}
    status, _, raw = request(server, "GET", "/metrics")
    assert status == 200 and "kiln_requests_total" in raw and "kiln_kv_cache_blocks" in raw
    with urllib.request.urlopen(server.metrics_url) as response:  # the same exposition as the metrics port
        names = {line.split()[2] for line in response.read().decode().splitlines() if line.startswith("# TYPE")}
    assert names == {line.split()[2] for line in raw.splitlines() if line.startswith("# TYPE")}


def test_tokenize_and_detokenize(server, llm):
    ids = llm.engine.tokenize(PROMPT)
    assert post(server, "/tokenize", {"prompt": PROMPT, "model": MODEL_NAME}) == (
        200, {"tokens": ids, "count": len(ids), "max_model_len": server.service.max_seq_len})
    status, r = post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert r["tokens"] == llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    messages = [{"role": "user", "content": "Sort a list."}]
    rendered = llm.tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, add_generation_prompt=True,
                                                 tokenize=False)
    status, r = post(server, "/tokenize", {"messages": messages})
    assert status == 200 and r["tokens"] == llm.tokenizer.encode(rendered) and r["count"] == len(r["tokens"])
    status, r = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert not llm.tokenizer.decode(r["tokens"]).endswith("<assistant>")
    assert post(server, "/detokenize", {"tokens": ids}) == (200, {"prompt": llm.tokenizer.decode(ids)})


@pytest.mark.parametrize("path, body, field", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "stream": True}, "stream"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1], "skip": 1}, "skip"),
])
def test_tokenize_errors_name_the_field(server, path, body, field):
    status, r = post(server, path, body)
    assert status == 400 and field in r["error"], r


def test_unknown_model_on_tokenize_is_404(server):
    assert post(server, "/tokenize", {"prompt": "a", "model": "gpt-4"})[0] == 404


def test_health_and_metrics_need_no_api_key_and_health_follows_readiness(tiny_code_engine):
    srv = start_server(tiny_code_engine, api_key="secret")
    try:
        assert request(srv, "GET", "/health")[0] == 200
        assert request(srv, "GET", "/metrics")[0] == 200
        assert request(srv, "GET", "/version")[0] == 401
        assert post(srv, "/tokenize", {"prompt": "a"})[0] == 401
        assert post(srv, "/tokenize", {"prompt": "a"}, headers={"Authorization": "Bearer secret"})[0] == 200
        srv.service.accepting = False  # what shutdown does first
        assert request(srv, "GET", "/health")[0] == 503
    finally:
        srv.stop()


def test_logprobs_never_hold_infinity(server):
    """A logprob of -inf (a token the model rules out) is sent as -9999.0, as OpenAI and vLLM do; JSON has no inf."""
    status, _, raw = request(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "echo": True,
                                                                  "logprobs": 5})
    assert status == 200 and "Infinity" not in raw and "NaN" not in raw
    assert all(v is None or math.isfinite(v) for v in json.loads(raw)["choices"][0]["logprobs"]["token_logprobs"])


def test_min_tokens_masks_stop_ids_only_in_rows_still_short():
    from kiln.runtime.sampling.min_tokens import apply_min_tokens
    from kiln.runtime.sampling.sampler import SamplingRow

    short = SamplingRow(SamplingParams(min_tokens=2, stop_token_ids=(3,)), [0], [5])
    done = SamplingRow(SamplingParams(min_tokens=1, stop_token_ids=(3,)), [0], [5])
    plain = SamplingRow(SamplingParams(), [0], [])
    assert apply_min_tokens(None, [done, plain], frozenset({1}), 8, torch.device("cpu")) is None
    mask = apply_min_tokens(None, [short, done, plain], frozenset({1}), 8, torch.device("cpu"))
    assert mask[0].tolist() == [True, False, True, False, True, True, True, True]
    assert mask[1:].all()
