"""Structured output and tool calls in `kiln serve`, without a server: the request fields -> GuidedDecoding
(serve/guided_request.py), tools and tool_choice (serve/openai/tool_specs.py), both tool-call formats read from
hand-written model outputs and the constraints that make a model write them (serve/openai/tool_calls.py), and how a
chat choice presents them, whole and streamed (serve/openai/tool_output.py)."""

from __future__ import annotations

import json

import pytest

from kiln.runtime.core.guided_decoding import GuidedDecoding
from kiln.serve.errors import InvalidRequest
from kiln.serve.guided_request import engine_refusal, openai_guided, triton_guided
from kiln.serve.openai.tool_calls import PARSERS, default_parser
from kiln.serve.openai.tool_output import ToolOutput
from kiln.serve.openai.tool_specs import check_tool_choice, check_tools, template_tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = check_tools([WEATHER, ADD])
LLAMA, HERMES = PARSERS["llama3_json"], PARSERS["hermes"]


def refused(call, *args) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        call(*args)
    return e.value


# ---- request fields -> GuidedDecoding -------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}}


@pytest.mark.parametrize("body, expected, field", [
    ({}, None, None),
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, GuidedDecoding(json_object=True), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     GuidedDecoding(json=SCHEMA), "response_format"),
    ({"guided_json": SCHEMA}, GuidedDecoding(json=SCHEMA), "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, GuidedDecoding(json=json.dumps(SCHEMA)), "guided_json"),
    ({"guided_regex": "[0-9]+"}, GuidedDecoding(regex="[0-9]+"), "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, GuidedDecoding(choice=("yes", "no")), "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, GuidedDecoding(grammar='root ::= "a"'), "guided_grammar"),
    ({"structured_outputs": {"regex": "a+", "json": None}}, GuidedDecoding(regex="a+"), "structured_outputs"),
    ({"structured_outputs": {"json_object": True}}, GuidedDecoding(json_object=True), "structured_outputs"),
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, GuidedDecoding(regex="a"), "guided_regex"),
])
def test_openai_fields_become_one_guided_decoding(body, expected, field):
    assert openai_guided(body) == (expected, field)


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": "json"}, "response_format", 'must be an object such as {"type": "json_object"}'),
    ({"response_format": {"type": "xml"}}, "response_format",
     'response_format.type="xml" is invalid: must be one of text, json_object, json_schema'),
    ({"response_format": {"type": "json_schema"}}, "response_format", "response_format.json_schema=null is invalid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format",
     "response_format.json_schema.name=null is invalid: must be a non-empty string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format",
     "response_format.json_schema.schema=[1] is invalid: must be a JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format", "response_format.json_schema.strict=\"yes\" is invalid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schemma": SCHEMA}}},
     "response_format", "response_format.json_schema has the unknown key \"schemma\""),
    ({"response_format": {"type": "json_object", "json_schema": {}}}, "response_format",
     "response_format has the unknown key \"json_schema\""),
    ({"guided_json": 3}, "guided_json", "guided_json=3 is invalid: must be a JSON schema"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json: guided_decoding.json='{not json' is invalid: not "
     "valid JSON text"),
    ({"guided_regex": ["a"]}, "guided_regex", 'guided_regex=["a"] is invalid: must be a string'),
    ({"guided_regex": " "}, "guided_regex", "must be a non-empty string"),
    ({"guided_choice": "yes"}, "guided_choice", 'guided_choice="yes" is invalid: must be a list of strings'),
    ({"guided_choice": []}, "guided_choice", "must list at least one string"),
    ({"guided_grammar": 1}, "guided_grammar", "guided_grammar=1 is invalid: must be a string"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "structured_outputs sets regex, choice: give one of"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", 'has the unknown key "pattern"'),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "give at most one of response_format, guided_json, guided_regex, guided_choice, guided_grammar, "
     "structured_outputs (got response_format and guided_regex)"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice", "(got guided_json and guided_choice)"),
])
def test_bad_openai_fields_are_400s_naming_them(body, param, message):
    e = refused(openai_guided, body)
    assert e.param == param and e.status == 400 and message in e.message, e.message


@pytest.mark.parametrize("guide_type, guide, expected", [
    (None, None, None),
    ("", None, None),
    ("json", None, GuidedDecoding(json_object=True)),
    ("json", "", GuidedDecoding(json_object=True)),
    ("json_schema", json.dumps(SCHEMA), GuidedDecoding(json=json.dumps(SCHEMA))),
    ("regex", "[a-z]+", GuidedDecoding(regex="[a-z]+")),
    ("ebnf_grammar", 'root ::= "a"', GuidedDecoding(grammar='root ::= "a"')),
])
def test_triton_inputs_become_guided_decoding(guide_type, guide, expected):
    assert triton_guided(guide_type, guide) == expected


@pytest.mark.parametrize("guide_type, guide, param, message", [
    (None, "[a-z]+", "guided_decoding_guide_type",
     "input 'guided_decoding_guide' needs input 'guided_decoding_guide_type' (one of json, json_schema, regex, "
     "ebnf_grammar)"),
    ("xml", "x", "guided_decoding_guide_type",
     "input 'guided_decoding_guide_type' is \"xml\"; it must be one of json, json_schema, regex, ebnf_grammar"),
    ("structural_tag", "{}", "guided_decoding_guide_type", "must be one of"),
    ("regex", None, "guided_decoding_guide", "guide type 'regex' needs input 'guided_decoding_guide'"),
    ("json_schema", "", "guided_decoding_guide", "needs input 'guided_decoding_guide' (the json schema)"),
    ("json", "{}", "guided_decoding_guide", "is not used with guide type 'json'"),
    ("json_schema", "{", "guided_decoding_guide",
     "input 'guided_decoding_guide': guided_decoding.json='{' is invalid: not valid JSON text"),
])
def test_bad_triton_guides_are_refused_naming_the_input(guide_type, guide, param, message):
    e = refused(triton_guided, guide_type, guide)
    assert e.param == param and message in e.message, e.message


def test_engine_refusals_name_the_field_of_the_constraint():
    bad = ValueError("guided_decoding.regex: invalid regex: Regex parsing error at position 2")
    e = engine_refusal(bad, "guided_regex")
    assert e.param == "guided_regex" and e.message == f"guided_regex: {bad}"
    other = engine_refusal(ValueError("prompt has 5000 tokens"), "guided_regex")
    assert other.param is None and other.message == "prompt has 5000 tokens"  # not the constraint's fault


# ---- tools and tool_choice -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tools, message", [
    ({"type": "function"}, "tools={\"type\": \"function\"} is invalid: must be a list"),
    ([{"type": "retrieval"}], "tools[0]={\"type\": \"retrieval\"} is invalid: must be an object with \"type\": "
     "\"function\""),
    ([{"type": "function"}], "tools[0].function=null is invalid: must be an object with a 'name'"),
    ([{"type": "function", "function": {"description": "x"}}], "tools[0].function.name=null is invalid"),
    ([{"type": "function", "function": {"name": ""}}], 'tools[0].function.name="" is invalid'),
    ([WEATHER, {"type": "function", "function": {"name": "get_weather"}}],
     'tools[1].function.name: the name "get_weather" is used by two tools'),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     'tools[0].function.parameters="{}" is invalid: must be a JSON schema object'),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tools[0].function.parameters=[1]"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description=3"),
    ([{"type": "function", "function": {"name": "f", "params": {}}}],
     'tools[0].function has the unknown key "params"'),
])
def test_bad_tools_are_400s(tools, message):
    e = refused(check_tools, tools)
    assert e.param == "tools" and message in e.message, e.message


def test_tools_default_to_no_parameters():
    [tool] = check_tools([{"type": "function", "function": {"name": "now"}}])
    assert tool.name == "now" and tool.parameters == {"type": "object", "properties": {}}
    assert check_tools(None) == [] and check_tools([]) == []


def test_tool_choice():
    assert check_tool_choice(None, TOOLS).mode == "auto" and check_tool_choice(None, []).mode == "none"
    assert check_tool_choice("none", TOOLS).tools == ()
    assert check_tool_choice("required", TOOLS).tools == tuple(TOOLS)
    named = check_tool_choice({"type": "function", "function": {"name": "add"}}, TOOLS)
    assert named.mode == "function" and [t.name for t in named.tools] == ["add"] and named.constrained
    assert check_tool_choice("auto", []).mode == "auto" and not check_tool_choice("auto", TOOLS).constrained


@pytest.mark.parametrize("choice, tools, message", [
    ("always", TOOLS, 'tool_choice="always" is invalid: must be one of none, auto, required'),
    ("required", [], 'tool_choice "required" needs tools: the request has none'),
    ({"type": "function", "function": {"name": "mul"}}, TOOLS,
     'tool_choice names the function "mul", which is not in tools (tools: get_weather, add)'),
    ({"type": "function", "function": {"name": "f"}}, [], "which is not in tools (tools: none)"),
    ({"type": "function", "name": "add"}, TOOLS, "is invalid: must be one of none, auto, required or"),
    (3, TOOLS, "tool_choice=3 is invalid"),
])
def test_bad_tool_choice_is_a_400(choice, tools, message):
    e = refused(check_tool_choice, choice, tools)
    assert e.param == "tool_choice" and message in e.message, e.message


def test_earlier_tool_calls_reach_the_template_with_object_arguments():
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    [converted] = template_tool_calls({"role": "assistant", "content": None, "tool_calls": [call]}, 1)
    assert converted["function"]["arguments"] == {"a": 1, "b": 2} and converted["id"] == "call_1"
    assert template_tool_calls({"role": "user", "content": "hi"}, 0) is None
    for message, text in [
        ({"role": "user", "tool_calls": [call]}, "messages[0].tool_calls is invalid: only an assistant message"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{"}}]},
         "messages[0].tool_calls[0].function.arguments is not valid JSON"),
        ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
         "messages[0].tool_calls[0] must be an object whose 'function' has a 'name' string"),
    ]:
        e = refused(template_tool_calls, message, 0)
        assert e.param == "messages" and text in e.message


# ---- reading tool calls -----------------------------------------------------------------------------------------
def calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_default_parser_by_architecture():
    assert default_parser("LlamaForCausalLM") == "llama3_json" and default_parser("MistralForCausalLM") == "llama3_json"
    assert default_parser("Qwen2ForCausalLM") == "hermes" and default_parser("Qwen3ForCausalLM") == "hermes"
    assert default_parser("GPT2LMHeadModel") == "llama3_json"


@pytest.mark.parametrize("text, expected", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    ('  <|python_tag|>{"name": "add", "arguments": {"a": 1, "b": 2}}\n', [("add", {"a": 1, "b": 2})]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Oslo"}};',
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
    ('{"name": "add", "parameters": "{\\"a\\": 1, \\"b\\": 2}"}', [("add", {"a": 1, "b": 2})]),
    ('{"name": "get_weather"}', [("get_weather", {})]),
])
def test_llama3_json_reads_calls(text, expected):
    parsed = LLAMA.parse(text, TOOLS)
    assert calls(parsed) == expected and parsed.content == ""
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parsed.calls)


@pytest.mark.parametrize("text", [
    "The weather is nice.",
    '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some text',
    '{"name": "mul", "parameters": {"a": 1}}',  # not a function of the request
    '{"name": "add", "parameters": {"a": 1, "b"',  # cut off by max_tokens
    '{"name": "add", "parameters": [1, 2]}',
    '{"answer": 42}',  # JSON, but not a call
    "",
])
def test_llama3_json_leaves_other_answers_as_content(text):
    assert LLAMA.parse(text, TOOLS).calls == [] and LLAMA.parse(text, TOOLS).content == text


def test_hermes_reads_calls_after_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
    parsed = HERMES.parse(text, TOOLS)
    assert calls(parsed) == [("get_weather", {"city": "Rome"}), ("add", {"a": 2, "b": 3})]
    assert parsed.content == "Let me check.\n"
    unclosed = HERMES.parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}', TOOLS)
    assert calls(unclosed) == [("add", {"a": 1, "b": 1})] and unclosed.content == ""


@pytest.mark.parametrize("text", [
    "Plain text, no calls.",
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>{"name": "mul", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "add", "argu',
])
def test_hermes_leaves_other_answers_as_content(text):
    parsed = HERMES.parse(text, TOOLS)
    assert parsed.calls == [] and parsed.content == text


def test_streaming_holds_back_what_may_be_a_call():
    assert [LLAMA.held_from(t) for t in ("", "  ", " {", "<|python", "<|python_tag|>{", "Sure", "Sure {")] == \
        [0, 0, 0, 0, 0, 4, 6]
    assert [HERMES.held_from(t) for t in ("Hi", "Hi <", "Hi <tool_", "Hi <tool_call>{", "a < b", "x<tool_call")] == \
        [2, 3, 3, 3, 5, 1]


# ---- the constraints that make a model write a call --------------------------------------------------------------
def test_llama3_json_constraint_is_a_schema_of_one_call():
    guided = LLAMA.constraint(TOOLS)
    one = {"type": "object", "properties": {"name": {"const": "add"}, "parameters": ADD["function"]["parameters"]},
           "required": ["name", "parameters"], "additionalProperties": False}
    assert guided.json["anyOf"][1] == one and len(guided.json["anyOf"]) == 2
    assert LLAMA.constraint(TOOLS[1:]) == GuidedDecoding(json=one)  # a named function: no anyOf


def test_hermes_constraint_accepts_exactly_a_tagged_call():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_ebnf(HERMES.constraint(TOOLS).grammar)
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 22}}\n</tool_call>'
    assert _is_grammar_accept_string(grammar, good)
    assert calls(HERMES.parse(good, TOOLS)) == [("add", {"a": 1, "b": 22})]
    for bad in ('{"name": "add", "arguments": {"a": 1, "b": 2}}',  # no tags
                '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',  # b is required
                '<tool_call>\n{"name": "mul", "arguments": {"a": 1, "b": 2}}\n</tool_call>'):
        assert not _is_grammar_accept_string(grammar, bad)


def test_a_parameters_schema_xgrammar_cannot_take_is_a_400():
    [tool] = check_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}])
    e = refused(HERMES.constraint, [tool])
    assert e.param == "tools" and "Unsupported type" in e.message


# ---- presenting a choice -----------------------------------------------------------------------------------------
def test_message_with_calls_has_null_content_and_finish_reason_tool_calls():
    output = ToolOutput(LLAMA, check_tool_choice("auto", TOOLS))
    message, finish = output.message('{"name": "add", "parameters": {"a": 1, "b": 2}}', "stop")
    assert finish == "tool_calls" and message["content"] is None and message["role"] == "assistant"
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert output.message("Hello", "length") == ({"role": "assistant", "content": "Hello"}, "length")
    hermes = ToolOutput(HERMES, check_tool_choice("auto", TOOLS))
    message, _ = hermes.message('Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', "stop")
    assert message["content"] == "Sure. " and len(message["tool_calls"]) == 1


def run_stream(output: ToolOutput, pieces: list[str], finish_reason: str = "stop"):
    """-> (the content sent, in order, per step; the tool-call deltas; the finish reason)."""
    stream, text, sent = output.stream(), "", []
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        content, deltas, finish = stream.step(text, last, finish_reason if last else None)
        sent.append(content)
    return sent, deltas, finish


def test_stream_auto_hermes_sends_content_then_calls_at_the_end():
    output = ToolOutput(HERMES, check_tool_choice("auto", TOOLS))
    sent, deltas, finish = run_stream(output, ["Let me", " look.<tool", '_call>{"name": "get_weather", ',
                                               '"arguments": {"city": "Oslo"}}', "</tool_call>"])
    assert sent == ["Let me", " look.", "", "", ""] and finish == "tool_calls"
    assert deltas[0] == [{"index": 0, "id": deltas[0][0]["id"], "type": "function",
                          "function": {"name": "get_weather", "arguments": ""}}]
    assert deltas[1] == [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}] and len(deltas) == 2


def test_stream_auto_sends_held_text_when_it_was_no_call():
    output = ToolOutput(LLAMA, check_tool_choice("auto", TOOLS))
    sent, deltas, finish = run_stream(output, ["{", '"x": 1', "}"], "length")
    assert "".join(sent) == '{"x": 1}' and sent[-1] == '{"x": 1}' and deltas == [] and finish == "length"
    sent, deltas, _ = run_stream(output, ["The", " answer"])
    assert sent == ["The", " answer"] and deltas == []
    sent, deltas, _ = run_stream(ToolOutput(HERMES, check_tool_choice("auto", TOOLS)), ["a <", "b"])
    assert sent == ["a ", "<b"]


def test_stream_required_holds_everything_and_sends_each_call():
    output = ToolOutput(LLAMA, check_tool_choice("required", TOOLS))
    sent, deltas, finish = run_stream(output, ['{"name": "add", ', '"parameters": {"a": 1, "b": 2}}'])
    assert sent == ["", ""] and finish == "tool_calls"
    assert [d[0]["function"] for d in deltas] == [{"name": "add", "arguments": ""}, {"arguments": '{"a": 1, "b": 2}'}]
