"""Structured output and tool calls through a real `kiln serve` on the bundled kiln-tiny-code: the `openai` package
(response_format, vLLM's guided_* extras, tools with tool_choice required / a named function / auto, streamed and
not) and tritonclient over HTTP and gRPC (the inputs guided_decoding_guide_type and guided_decoding_guide).
Outputs are checked against their schema by hand; bad schemas, regexes, grammars and tool specs are 400s (gRPC
INVALID_ARGUMENT) whose message says what is wrong, after which the server still serves and every KV block is
free. The parsers themselves are tested on hand-written outputs in test_serve_guided_parsing.py."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serve_util import MODEL_NAME, start_server, triton_inputs
from tritonclient.utils import InferenceServerException

# A chat template that shows the tools and how to call one, and renders earlier calls in the llama3_json format
# (simpler than the bundled model's own). transformers trims the newline after a block tag, so
# newlines are written as expressions.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{{ '\\n' }}{% for tool in tools %}{{ tool.function.name }}: "
    "{{ tool.function.parameters | tojson }}{{ '\\n' }}{% endfor %}</tools>{{ '\\n' }}"
    "To call a tool, answer {\"name\": <tool name>, \"parameters\": <its arguments>}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Schemas whose every value is bounded, so that the tiny model finishes them well within max_tokens.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "admin": {"type": "boolean"}, "team": {"enum": ["red", "blue"]}}, "required": ["name", "age", "admin", "team"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
REGEX = "[0-9]{3}-[a-z]{2,4}"


@pytest.fixture(scope="module")
def server(tiny_code_engine):
    """kiln serve with the tool template and the architecture's parser (Llama: llama3_json)."""
    srv = start_server(tiny_code_engine, chat_template=TOOL_TEMPLATE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http_base + "/v1", api_key="none", max_retries=0)


def matches(value, schema: dict) -> bool:
    """Whether `value` follows `schema` (the keywords the schemas here use), checked by hand."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties", {})
        return (isinstance(value, dict) and set(schema.get("required", [])) <= set(value)
                and set(value) <= set(properties) and all(matches(value[k], properties[k]) for k in value))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    raise AssertionError(f"matches() does not know {schema}")


def blocks_all_free(server, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.kv_cache_stats()
        if stats["free_blocks"] == stats["total_blocks"] and server.service.num_inflight == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def still_serves(client) -> None:
    assert client.completions.create(model=MODEL_NAME, prompt="def f(", max_tokens=2).usage.completion_tokens == 2


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.http_base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- response_format and the guided_* extras ---------------------------------------------------------------------
def test_chat_json_schema_answers_json_that_follows_the_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=80, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    assert matches(json.loads(r.choices[0].message.content), PERSON), r.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=80, temperature=0,
                                                 response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


def test_json_object_on_chat_and_completions(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0.8, seed=3,
                                       response_format={"type": "json_object"}, n=2)
    for choice in r.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # sampled, the tiny model may write a long object: what it wrote is still an object's start
            assert choice.message.content.startswith("{")
    c = client.completions.create(model=MODEL_NAME, prompt="data = ", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert c.choices[0].finish_reason == "stop" and isinstance(json.loads(c.choices[0].text), dict)


def test_completions_take_vllm_guided_extras(client):
    r = client.completions.create(model=MODEL_NAME, prompt=["x = ", "if ready:"], max_tokens=10, temperature=0,
                                  extra_body={"guided_choice": ["True", "False", "None"]})
    assert [c.text in ("True", "False", "None") for c in r.choices] == [True, True]
    r = client.completions.create(model=MODEL_NAME, prompt="id = ", max_tokens=12, temperature=1.0, seed=5, n=3,
                                  extra_body={"guided_regex": REGEX})
    assert all(re.fullmatch(REGEX, c.text) for c in r.choices), [c.text for c in r.choices]
    r = client.completions.create(model=MODEL_NAME, prompt="age = ", max_tokens=40, temperature=0,
                                  extra_body={"guided_json": PERSON})
    assert matches(json.loads(r.choices[0].text), PERSON)
    r = client.completions.create(model=MODEL_NAME, prompt="answer: ", max_tokens=10, temperature=0,
                                  extra_body={"guided_grammar": 'root ::= ("yes" | "no") "!"'})
    assert r.choices[0].text in ("yes!", "no!")
    streamed = client.completions.create(model=MODEL_NAME, prompt="id = ", max_tokens=12, temperature=0, stream=True,
                                         extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, "".join(c.choices[0].text for c in streamed))


def test_chat_takes_guided_choice(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                       extra_body={"guided_choice": ["sunny", "rainy"]})
    assert r.choices[0].message.content in ("sunny", "rainy") and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra, param, message", [
    ({"guided_regex": "([a-z]"}, "guided_regex",
     "guided_regex: guided_decoding.regex: invalid regex: Regex parsing error at position"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json",
     'guided_json: guided_decoding.json: invalid JSON schema: Unsupported type "nonsense"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#/nowhere"}}}},
     "response_format", "response_format: guided_decoding.json: invalid JSON schema:"),
    ({"guided_grammar": 'root ::= "a" | rule_without_definition'}, "guided_grammar",
     'guided_grammar: guided_decoding.grammar: invalid EBNF grammar: EBNF parser error at line 1, column'),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "(got guided_regex and guided_choice)"),
    ({"response_format": {"type": "yaml"}}, "response_format", 'response_format.type="yaml" is invalid'),
])
def test_bad_constraints_are_400s_naming_the_field(server, client, stream, extra, param, message):
    for create, kwargs in ((client.completions.create, {"prompt": "x = "}),
                           (client.chat.completions.create, {"messages": MESSAGES})):
        with pytest.raises(openai.BadRequestError) as e:
            result = create(model=MODEL_NAME, max_tokens=4, stream=stream, extra_body=extra, **kwargs)
            list(result) if stream else None
        assert e.value.body["param"] == param and message in e.value.body["message"], e.value.body
    assert blocks_all_free(server)
    still_serves(client)


# ---- tools ---------------------------------------------------------------------------------------------------------
def tool_schema(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def check_calls(message, names: set[str]) -> None:
    """The SDK's parsed tool calls: ids, known names, arguments JSON that follows the function's schema."""
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        assert matches(json.loads(call.function.arguments), tool_schema(call.function.name)), call.function.arguments


def streamed_calls(chunks) -> tuple[dict[int, dict], str | None, str]:
    """Tool-call deltas put together as OpenAI's clients do -> ({index: {id, name, arguments}}, finish_reason,
    content)."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                if delta.id:
                    assert call["id"] is None and delta.type == "function"  # id and type once, first
                    call["id"] = delta.id
                if delta.function and delta.function.name:
                    call["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    return calls, finish, content


def test_named_function_is_called_with_arguments_that_follow_its_schema(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                       max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message, {"get_weather"})
    [call] = r.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=60, temperature=0, stream=True))
    calls, finish, content = streamed_calls(chunks)
    assert finish == "tool_calls" and content == "" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert calls[0]["arguments"] == call.function.arguments  # greedy: the same call


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_one_of_the_tools(client, stream):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Add 2 and 3."}],
                                       tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0.7, seed=1,
                                       n=2, stream=stream)
    if not stream:
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls"
            check_calls(choice.message, {"get_weather", "add"})
        return
    chunks = list(r)
    for index in (0, 1):
        calls, finish, _ = streamed_calls(c for c in chunks if c.choices and c.choices[0].index == index)
        assert finish == "tool_calls" and list(calls) == [0]
        assert matches(json.loads(calls[0]["arguments"]), tool_schema(calls[0]["name"]))


@pytest.mark.parametrize("stream", [False, True])
def test_auto_gets_a_plain_answer_from_the_tiny_model(client, stream):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=16, temperature=0)
    plain = client.chat.completions.create(**kwargs, tool_choice="none")
    assert plain.choices[0].message.tool_calls is None
    r = client.chat.completions.create(**kwargs, stream=stream)  # tool_choice defaults to "auto"
    if stream:
        calls, finish, content = streamed_calls(r)
    else:
        calls, finish, content = {}, r.choices[0].finish_reason, r.choices[0].message.content
        assert r.choices[0].message.tool_calls is None
    assert calls == {} and finish in ("stop", "length") and content == plain.choices[0].message.content


def test_tools_reach_the_template_and_earlier_calls_render(server, client):
    without = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1)
    with_tools = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=1)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 20
    status, body = post(server, "/tokenize", {"messages": MESSAGES, "tools": TOOLS})  # vLLM's route, with tools
    assert status == 200 and body["count"] == with_tools.usage.prompt_tokens
    status, body = post(server, "/tokenize", {"prompt": "x", "tools": TOOLS})
    assert status == 400 and body["error"] == "tools applies to 'messages'"
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=4)
    assert r.usage.prompt_tokens > with_tools.usage.prompt_tokens


@pytest.mark.parametrize("kwargs, param, message", [
    ({"tools": {"type": "function"}}, "tools", "must be a list"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools",
     "tools[0].function.name=null is invalid"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools",
     'tools[0].function.parameters="{}" is invalid: must be a JSON schema object'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice",
     'tool_choice names the function "mul", which is not in tools'),
    ({"tool_choice": "required"}, "tool_choice", 'tool_choice "required" needs tools'),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", 'tool_choice="sometimes" is invalid'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools", 'tools: guided_decoding.json: invalid JSON schema: Unsupported type'),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "response_format cannot be combined with tool_choice 'required'"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "add", "arguments": "{not json"}}]}]}, "messages",
     "messages[0].tool_calls[0].function.arguments is not valid JSON"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tool_specs_are_400s(server, client, kwargs, param, message, stream):
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "stream": stream, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        result = client.chat.completions.create(**kwargs)
        list(result) if stream else None
    assert e.value.body["param"] == param and message in e.value.body["message"], e.value.body
    assert blocks_all_free(server)


def test_hermes_parser(tiny_code_engine):
    """--tool-call-parser hermes: the model is constrained to <tool_call> blocks, which are read back as calls."""
    srv = start_server(tiny_code_engine, chat_template=TOOL_TEMPLATE, tool_call_parser="hermes")
    try:
        client = openai.OpenAI(base_url=srv.http_base + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=60, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(r.choices[0].message, {"get_weather", "add"})
        calls, finish, content = streamed_calls(client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function",
                                                                           "function": {"name": "add"}},
            max_tokens=60, temperature=0, stream=True))
        assert finish == "tool_calls" and content == "" and calls[0]["name"] == "add"
        assert matches(json.loads(calls[0]["arguments"]), tool_schema("add"))
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                           temperature=0)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    finally:
        srv.stop()


def test_tool_call_parser_is_checked(tiny_code_engine):
    from kiln.serve.config import ServeConfig

    with pytest.raises(ValueError, match="tool_call_parser='mistral' is invalid: must be one of llama3_json, hermes, deepseek_v3, "
                                         "deepseek_v31, harmony"):
        ServeConfig(engine_dir=str(tiny_code_engine), tool_call_parser="mistral")


# ---- Triton / KServe -------------------------------------------------------------------------------------------------
def test_guided_inputs_are_in_the_metadata_and_config(server):
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        inputs = {t["name"]: t for t in client.get_model_metadata(MODEL_NAME)["inputs"]}
        config = {t["name"]: t for t in client.get_model_config(MODEL_NAME)["input"]}
    finally:
        client.close()
    for name in ("guided_decoding_guide_type", "guided_decoding_guide"):
        assert inputs[name] == {"name": name, "datatype": "BYTES", "shape": [-1, 1]}
        assert config[name]["data_type"] == "TYPE_STRING" and config[name]["optional"] is True


def test_triton_http_infer_and_generate_with_a_guide(server):
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        result = client.infer(MODEL_NAME, triton_inputs(httpclient, "user = ", "json_schema", json.dumps(PERSON)))
        assert matches(json.loads(result.as_numpy("text_output")[0, 0].decode()), PERSON)
        result = client.infer(MODEL_NAME, triton_inputs(httpclient, "data = ", "json", None))
        assert isinstance(json.loads(result.as_numpy("text_output")[0, 0].decode()), dict)
    finally:
        client.close()
    status, body = post(server, f"/v2/models/{MODEL_NAME}/generate", {
        "text_input": "id = ", "max_tokens": 12, "exclude_input_in_output": True,
        "guided_decoding_guide_type": "regex", "guided_decoding_guide": REGEX})
    assert status == 200 and re.fullmatch(REGEX, body["text_output"]), body
    status, body = post(server, f"/v2/models/{MODEL_NAME}/generate", {
        "text_input": "ok = ", "max_tokens": 12, "exclude_input_in_output": True,
        "parameters": {"guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": 'root ::= "yes" | "no"'}})
    assert status == 200 and body["text_output"] in ("yes", "no"), body


def test_triton_grpc_infer_and_stream_with_a_guide(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        result = client.infer(MODEL_NAME, triton_inputs(grpcclient, "user = ", "json_schema", json.dumps(PERSON)))
        assert matches(json.loads(result.as_numpy("text_output")[0, 0].decode()), PERSON)
        pieces, errors = [], []

        def callback(result, error):
            errors.append(error) if error else pieces.append(result.as_numpy("text_output")[0, 0].decode())
        client.start_stream(callback)
        try:
            client.async_stream_infer(MODEL_NAME, triton_inputs(grpcclient, "id = ", "regex", REGEX, 12,
                                                                stream=(True, "BOOL")), request_id="r")
            client.async_stream_infer(MODEL_NAME, triton_inputs(grpcclient, "id = ", "regex", "([a-z]", 12,
                                                                stream=(True, "BOOL")), request_id="bad")
        finally:
            client.stop_stream()  # waits for both requests to end
    finally:
        client.close()
    assert re.fullmatch(REGEX, "".join(pieces)) and len(pieces) > 1, pieces
    [error] = errors
    assert "input 'guided_decoding_guide': guided_decoding.regex: invalid regex" in error.message()


@pytest.mark.parametrize("guide_type, guide, message", [
    (None, REGEX, "input 'guided_decoding_guide' needs input 'guided_decoding_guide_type'"),
    ("protobuf", "x", "input 'guided_decoding_guide_type' is \"protobuf\"; it must be one of json, json_schema, "
     "regex, ebnf_grammar"),
    ("json_schema", None, "guide type 'json_schema' needs input 'guided_decoding_guide'"),
    ("regex", "([a-z]", "input 'guided_decoding_guide': guided_decoding.regex: invalid regex: Regex parsing error"),
    ("json_schema", '{"type": "nonsense"}', "input 'guided_decoding_guide': guided_decoding.json: invalid JSON "
     'schema: Unsupported type "nonsense"'),
    ("ebnf_grammar", "root ::=", "input 'guided_decoding_guide': guided_decoding.grammar: invalid EBNF grammar"),
])
def test_bad_triton_guides_are_refused(server, guide_type, guide, message):
    http = httpclient.InferenceServerClient(server.http_url)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as e:
            http.infer(MODEL_NAME, triton_inputs(httpclient, "x = ", guide_type, guide))
        assert e.value.status() == "400" and message in e.value.message(), e.value.message()
        with pytest.raises(InferenceServerException) as e:
            grpc.infer(MODEL_NAME, triton_inputs(grpcclient, "x = ", guide_type, guide))
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and message in e.value.message()
        body = {"text_input": "x", "max_tokens": 4, "guided_decoding_guide_type": guide_type,
                "guided_decoding_guide": guide}
        status, answer = post(server, f"/v2/models/{MODEL_NAME}/generate_stream",
                              {k: v for k, v in body.items() if v is not None})
        assert status == 400 and message in answer["error"]
    finally:
        http.close()
        grpc.close()
    assert blocks_all_free(server)
