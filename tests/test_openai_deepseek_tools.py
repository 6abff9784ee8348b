"""DeepSeek's tool calls in /v1/chat/completions (serve/openai/deepseek_tools.py): the V3 and V3.1 layouts read from
hand-written answers, the constraints for a forced call, the choice of layout by chat template, and end to end
through `kiln serve` with the `openai` client on a tiny random DeepSeek-V3 whose tokenizer has DeepSeek's tool tokens
(added, not special, as in DeepSeek's releases) and a chat template written as DeepSeek's are (calls concatenated
into the text with `+`). A random model writes a call only when constrained (tool_choice required or named)."""

from __future__ import annotations

import json

import pytest

from kiln.serve.openai.deepseek_tools import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    deepseek_layout,
)
from kiln.serve.openai.tool_calls import PARSERS, default_parser
from kiln.serve.openai.tool_specs import check_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"]}}}
TOOLS_SPEC = [WEATHER, ADD]
TOOLS = check_tools(TOOLS_SPEC)
V3, V31 = PARSERS["deepseek_v3"], PARSERS["deepseek_v31"]


def v3_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def v31_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


def args(**values) -> str:
    return json.dumps(values)  # ", " and ": ", as the constraint writes JSON


def calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


# ---- reading calls ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parser", [V3, V31])
def test_both_layouts_are_read_after_content(parser):
    v3 = f'Let me look.{CALLS_BEGIN}{v3_call("get_weather", json.dumps({"city": "Rome"}))}\n' \
         f'{v3_call("add", args(a=2, b=3))}{CALLS_END}'
    parsed = parser.parse(v3, TOOLS)
    assert calls(parsed) == [("get_weather", {"city": "Rome"}), ("add", {"a": 2, "b": 3})]
    assert parsed.content == "Let me look."
    v31 = f'{CALLS_BEGIN}{v31_call("add", args(a=1, b=9))}{v31_call("get_weather", args(city="Oslo"))}{CALLS_END}'
    parsed = parser.parse(v31, TOOLS)
    assert calls(parsed) == [("add", {"a": 1, "b": 9}), ("get_weather", {"city": "Oslo"})] and parsed.content == ""
    assert all(c.id.startswith("call_") for c in parsed.calls)


def test_a_last_call_cut_before_its_end_tokens_is_read():
    assert calls(V3.parse(f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}add\n```json\n{{"a": 1, "b": 1}}\n```', TOOLS)) \
        == [("add", {"a": 1, "b": 1})]
    assert calls(V31.parse(f'{CALLS_BEGIN}{CALL_BEGIN}add{SEP}{{"a": 4, "b": 5}}', TOOLS)) == [("add", {"a": 4, "b": 5})]


@pytest.mark.parametrize("text", [
    "Plain text, no calls.",
    f"{CALLS_BEGIN}{v3_call('add', 'not json')}{CALLS_END}",
    f"{CALLS_BEGIN}{v31_call('mul', '{}')}{CALLS_END}",  # not a function of the request
    f"{CALLS_BEGIN}{v31_call('add', '[1, 2]')}{CALLS_END}",  # arguments not an object
    f"{CALLS_BEGIN}{v31_call('add', '{}')}{CALL_BEGIN}add{SEP}{{\"a\": 1, ",  # the second call cut mid-arguments
    f"{CALLS_BEGIN}{CALLS_END}",  # the tokens with no call
    f"{CALLS_BEGIN}",
])
def test_other_answers_are_content(text):
    for parser in (V3, V31):
        parsed = parser.parse(text, TOOLS)
        assert parsed.calls == [] and parsed.content == text


def test_streaming_holds_back_what_may_be_a_call():
    begin = CALLS_BEGIN
    texts = ("Hi", "Hi <", "Hi <｜tool", "Hi " + begin, "Hi " + begin + CALL_BEGIN, "a < b", "x" + begin[:3])
    assert [V3.held_from(t) for t in texts] == [2, 3, 3, 3, 3, 5, 1]


def test_streamed_auto_answers_add_up_to_the_whole_message():
    """Content streams until DeepSeek's opening token might start; the calls come whole at the end; for any cuts."""
    import random

    from kiln.serve.openai.tool_output import ToolOutput
    from kiln.serve.openai.tool_specs import check_tool_choice

    rng = random.Random(0)
    texts = [f'Sure. {CALLS_BEGIN}{v3_call("add", args(a=1, b=2))}\n{v3_call("get_weather", args(city="Rome"))}'
             f'{CALLS_END}', f'{CALLS_BEGIN}{v31_call("add", args(a=3, b=4))}{CALLS_END}', "No <｜tool but text."]
    for parser, text in [(p, t) for p in (V3, V31) for t in texts]:
        whole, finish = ToolOutput(parser, check_tool_choice(None, TOOLS)).message(text, "stop")
        want = (whole["content"] or "", [(c["function"]["name"], c["function"]["arguments"])
                                         for c in whole.get("tool_calls", [])], finish)
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), 5)) + [len(text)]
            stream, content, calls, sent = ToolOutput(parser, check_tool_choice(None, TOOLS)).stream(), "", [], None
            for k, cut in enumerate(cuts):
                last = k == len(cuts) - 1
                deltas, sent = stream.deltas(text[:cut], last, "stop" if last else None)
                content += "".join(d.get("content", "") for d in deltas)
                for d in deltas:
                    for c in d.get("tool_calls", []):
                        if "name" in c["function"]:
                            calls.append([c["function"]["name"], ""])
                        else:
                            calls[c["index"]][1] += c["function"]["arguments"]
            assert (content, [tuple(c) for c in calls], sent) == want, cuts


# ---- the constraints ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parser, call, other", [(V3, v3_call, v31_call), (V31, v31_call, v3_call)])
def test_the_constraint_accepts_exactly_one_call_in_its_layout(parser, call, other):
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_ebnf(parser.constraint(TOOLS).grammar)
    good = f'{CALLS_BEGIN}{call("add", args(a=1, b=22))}{CALLS_END}'
    assert _is_grammar_accept_string(grammar, good)
    assert calls(parser.parse(good, TOOLS)) == [("add", {"a": 1, "b": 22})]
    weather = f'{CALLS_BEGIN}{call("get_weather", args(city="Oslo"))}{CALLS_END}'
    assert _is_grammar_accept_string(grammar, weather)
    two = args(a=1, b=2)
    for bad in (f'{CALLS_BEGIN}{other("add", two)}{CALLS_END}',  # the other layout
                f'{CALLS_BEGIN}{call("add", args(a=1))}{CALLS_END}',  # b is required
                f'{CALLS_BEGIN}{call("get_weather", two)}{CALLS_END}',  # add's arguments, weather's name
                f'{CALLS_BEGIN}{call("mul", two)}{CALLS_END}',
                call("add", two)):  # no outer tokens
        assert not _is_grammar_accept_string(grammar, bad), bad
    named = xgr.Grammar.from_ebnf(parser.constraint(TOOLS[1:]).grammar)  # tool_choice naming add
    assert _is_grammar_accept_string(named, good) and not _is_grammar_accept_string(named, weather)


# ---- which layout -------------------------------------------------------------------------------------------------
V3_TEMPLATE = (
    "{{ bos_token }}{% if tools %}## Tools\n{% for tool in tools %}### {{ tool.function.name }}\n"
    "Parameters: {{ tool.function.parameters | tojson }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}<｜Assistant｜><｜tool▁calls▁begin｜>"
    "{% for tool in message['tool_calls'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n'"
    " + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>' }}{% endfor %}"
    "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    "{% elif message['role'] == 'assistant' %}<｜Assistant｜>{{ message['content'] }}<｜end▁of▁sentence｜>"
    "{% elif message['role'] == 'tool' %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ message['content'] }}"
    "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
V31_TEMPLATE = V3_TEMPLATE.replace(
    "'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n'"
    " + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'",
    "'<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments']"
    " + '<｜tool▁call▁end｜>'")


def test_the_layout_follows_the_chat_template():
    assert V31_TEMPLATE != V3_TEMPLATE
    for architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        assert default_parser(architecture, V3_TEMPLATE) == "deepseek_v3"
        assert default_parser(architecture, V31_TEMPLATE) == "deepseek_v31"
        assert default_parser(architecture, None) == "deepseek_v3"  # V2.5 / V3 / R1 write V3's
    assert deepseek_layout("{{ messages }}") == "deepseek_v3"


# ---- end to end ---------------------------------------------------------------------------------------------------
DEEPSEEK_TOKENS = [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, "<｜tool▁outputs▁begin｜>",
                   "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜User｜>",
                   "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from test_models_deepseek import CASES, make_checkpoint
    from tokenizer_factory import make_test_tokenizer
    from tokenizers import AddedToken

    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    tmp = tmp_path_factory.mktemp("deepseek-tools")
    architecture, overrides = CASES["v3"]
    checkpoint, _ = make_checkpoint(tmp / "ckpt", architecture, **overrides, vocab_size=416,
                                    max_position_embeddings=1024)
    tokenizer = make_test_tokenizer(checkpoint)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in DEEPSEEK_TOKENS])
    tokenizer.chat_template = V3_TEMPLATE
    tokenizer.save_pretrained(checkpoint)
    # A trained DeepSeek writes each tool token as one token; the random model, steered by the constraint only,
    # would spell them out byte by byte: a logit bias on them stands in for the training.
    bias = {str(i): 50 for i in tokenizer.convert_tokens_to_ids([CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP])}
    return build_engine(checkpoint, tmp / "engine", BuildConfig(dtype="float32", max_batch_size=4, max_num_tokens=512,
                                                                 max_seq_len=1024), progress=False), bias


@pytest.fixture(scope="module", params=["v3", "v31"])
def client(request, engine):
    """`kiln serve` with the engine's own (V3) template, or V3.1's given as --chat-template (no parser named) ->
    (the template's layout, the OpenAI client, the tool tokens' logit bias)."""
    openai = pytest.importorskip("openai")
    from serve_util import start_server

    engine, bias = engine
    server = start_server(engine, chat_template=None if request.param == "v3" else V31_TEMPLATE)
    yield request.param, openai.OpenAI(base_url=server.http_base + "/v1", api_key="none", max_retries=0), bias
    server.stop()


def _arguments_follow(name: str, arguments: str) -> None:
    value = json.loads(arguments)
    if name == "add":
        assert set(value) == {"a", "b"} and all(0 <= value[k] <= 99 for k in value), value
    else:
        assert value["city"] in ("Paris", "Rome", "Oslo"), value


def test_a_required_call_comes_back_as_tool_calls(client):
    """...in the layout of the template served (the answer's tokens, from its logprobs, show which)."""
    layout, client, bias = client
    r = client.chat.completions.create(model="kiln-tiny-code", messages=MESSAGES, tools=TOOLS_SPEC,
                                       tool_choice="required", max_tokens=80, temperature=0, logit_bias=bias,
                                       logprobs=True)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "add")
    _arguments_follow(call.function.name, call.function.arguments)
    written = "".join(t.token for t in choice.logprobs.content)
    opening = {"v3": f"{CALL_BEGIN}function{SEP}{call.function.name}\n```json\n",
               "v31": f"{CALL_BEGIN}{call.function.name}{SEP}"}[layout]
    assert written.startswith(CALLS_BEGIN + opening) and CALLS_END in written, written  # then the EOS token


def test_a_named_call_streams_as_tool_call_deltas(client):
    _, client, bias = client
    name, arguments, content, finish = None, "", "", None
    for chunk in client.chat.completions.create(model="kiln-tiny-code", messages=MESSAGES, tools=TOOLS_SPEC,
                                                tool_choice={"type": "function", "function": {"name": "add"}},
                                                max_tokens=80, temperature=0, stream=True, logit_bias=bias):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                name = delta.function.name or name
                arguments += delta.function.arguments or ""
    assert finish == "tool_calls" and content == "" and name == "add"
    _arguments_follow("add", arguments)


def test_auto_without_a_call_is_content_and_history_goes_through_the_template(client):
    """tool_choice auto: the random model writes text, which is content. A conversation with an earlier call and
    its result renders through the DeepSeek-style template (arguments concatenated as text)."""
    _, client, _ = client
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    for messages in (MESSAGES, history):
        r = client.chat.completions.create(model="kiln-tiny-code", messages=messages, tools=TOOLS_SPEC, max_tokens=6,
                                           temperature=0)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content, r.choices[0]
        assert r.choices[0].finish_reason == "length"
