"""Reasoning read out of chat answers (`kiln serve --reasoning-parser deepseek_r1|qwen3`, serve/openai/reasoning.py) and
`chat_template_kwargs`: the split on hand-written answers, whole and streamed in random chunkings, with tool calls
after the reasoning, and end to end through `kiln serve` with the `openai` client (the tiny model writes no
`</think>`: a template that opens the block makes its whole answer reasoning; `enable_thinking: false` reaches the
template, which closes the block in the prompt, and the answer is content)."""

from __future__ import annotations

import random

import pytest

from kiln.serve.errors import InvalidRequest
from kiln.serve.openai.chat import chat_template_variables, template_kwargs
from kiln.serve.openai.reasoning import ReasoningOutput, prompt_opens_block, split
from kiln.serve.openai.tool_calls import PARSERS
from kiln.serve.openai.tool_output import ToolOutput
from kiln.serve.openai.tool_specs import check_tool_choice, check_tools

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOLS = check_tools([ADD])
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize("opened, text, reasoning, answer", [
    (True, "Let me see.\n</think>\n\nIt is 4.", "Let me see.\n", "It is 4."),  # R1: the prompt opened the block
    (True, "<think>\nLet me see.</think>It is 4.", "Let me see.", "It is 4."),  # and the model opened it again
    (True, "Still thinking when cut", "Still thinking when cut", ""),
    (True, "</think>Straight to it", "", "Straight to it"),
    (False, "<think>\nPlan.\n</think>\n\nDone.", "Plan.\n", "Done."),  # Qwen3: the model opens it
    (False, "  <think>cut mid-thought", "cut mid-thought", ""),
    (False, "No thinking here. </think> stays", "", "No thinking here. </think> stays"),
    (False, "", "", ""),
])
def test_the_split(opened, text, reasoning, answer):
    parts = split(text, opened, final=True)
    assert (parts.reasoning, parts.answer) == (reasoning, answer)


def test_a_prompt_opens_the_block_when_it_ends_with_think():
    assert prompt_opens_block("<｜User｜>Hi<｜Assistant｜><think>\n")  # DeepSeek-R1's generation prompt
    assert prompt_opens_block("<|im_start|>assistant\n<think>\n")  # Qwen3-Thinking's
    assert not prompt_opens_block("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not prompt_opens_block("<|im_start|>user\nWhat is <think>?<|im_end|>\n<|im_start|>assistant\n")


def test_a_whole_message_has_reasoning_content_and_null_content_when_only_reasoning():
    message, finish = ReasoningOutput(None, True, False).message("a</think>b", "stop")
    assert message == {"role": "assistant", "content": "b", "reasoning_content": "a", "reasoning": "a"}
    message, finish = ReasoningOutput(None, True, False).message("thinking", "length")
    assert message["content"] is None and message["reasoning_content"] == "thinking" and finish == "length"
    message, _ = ReasoningOutput(None, False, False).message("plain", "stop")
    assert message == {"role": "assistant", "content": "plain"}


def test_tool_calls_after_the_reasoning_and_a_constrained_answer_whole():
    tools = ToolOutput(PARSERS["hermes"], check_tool_choice(None, TOOLS))
    message, finish = ReasoningOutput(tools, False, False).message(f"<think>Add them.</think>\n\n{CALL}", "stop")
    assert message["reasoning_content"] == "Add them." and message["content"] is None and finish == "tool_calls"
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    # a forced call (or guided decoding) follows its grammar from the first token: no reasoning to split off
    forced = ToolOutput(PARSERS["hermes"], check_tool_choice("required", TOOLS))
    message, finish = ReasoningOutput(forced, True, True).message(CALL, "stop")
    assert "reasoning_content" not in message and finish == "tool_calls" and message["tool_calls"]


def _assemble(output: ReasoningOutput, text: str, cuts: list[int]) -> tuple[dict, str | None]:
    stream, reasoning, content, calls, sent_finish = output.stream(), "", "", [], None
    for k, cut in enumerate(cuts):
        finished = k == len(cuts) - 1
        deltas, finish = stream.deltas(text[:cut], finished, "stop" if finished else None)
        sent_finish = finish if finished else sent_finish
        for d in deltas:
            assert d and all(v for v in d.values())  # no empty deltas
            reasoning += d.get("reasoning_content", "")
            content += d.get("content", "")
            calls += [c["function"] for c in d.get("tool_calls", []) if "name" not in c["function"]]
    return {"reasoning": reasoning, "content": content, "arguments": [c["arguments"] for c in calls]}, sent_finish


@pytest.mark.parametrize("opened, text, tools", [
    (True, "Let me see.\n</think>\n\nIt is 4.", False),
    (True, "<think>\nHmm </thi nk> no</think>\nYes", False),
    (False, "<think>\nPlan.\n</think>\n\nDone.", False),
    (False, "<thinking is not a tag", False),
    (False, " \n <think>Spaced.</think> Out", False),  # whitespace first: not sent as content before the block
    (False, f"<think>Add them.</think>\n\n{CALL}", True),
    (True, f"Add them.</think>Sure. {CALL}", True),
])
def test_streaming_in_any_chunking_adds_up_to_the_whole_answer(opened, text, tools):
    def output():
        return ReasoningOutput(ToolOutput(PARSERS["hermes"], check_tool_choice(None, TOOLS)) if tools else None,
                               opened, False)

    whole, finish = output().message(text, "stop")
    expected = {"reasoning": whole.get("reasoning_content") or "", "content": whole["content"] or "",
                "arguments": [c["function"]["arguments"] for c in whole.get("tool_calls", [])]}
    rng = random.Random(0)
    chunkings = [[len(text)], list(range(1, len(text) + 1))]
    chunkings += [sorted(rng.sample(range(1, len(text)), rng.randint(1, 12))) + [len(text)] for _ in range(40)]
    for cuts in chunkings:
        got, sent_finish = _assemble(output(), text, cuts)
        assert got == expected and sent_finish == finish, cuts


def test_reasoning_streams_as_it_comes_holding_only_a_possible_end_tag():
    stream = ReasoningOutput(None, True, False).stream()
    assert stream.deltas("Thinking ab", False, None)[0] == [{"reasoning_content": "Thinking ab",
                                                              "reasoning": "Thinking ab"}]
    assert stream.deltas("Thinking about it</th", False, None)[0] == [{"reasoning_content": "out it",
                                                                        "reasoning": "out it"}]
    assert stream.deltas("Thinking about it</think>\n", False, None)[0] == []
    assert stream.deltas("Thinking about it</think>\nOK", False, None)[0] == [{"content": "OK"}]
    qwen = ReasoningOutput(None, False, False).stream()
    assert qwen.deltas("<thi", False, None)[0] == []  # may become <think>
    assert qwen.deltas("<thx", False, None)[0] == [{"content": "<thx"}]


@pytest.mark.parametrize("kwargs, message", [
    ([1], "must be an object of template variables"),
    ({"1x": True}, "must be an object of template variables"),
    ({"tools": []}, "may not set tools"),
    ({"add_generation_prompt": False, "tokenize": True}, "may not set add_generation_prompt, tokenize"),
])
def test_bad_chat_template_kwargs_are_400s(kwargs, message):
    with pytest.raises(InvalidRequest) as e:
        template_kwargs({"chat_template_kwargs": kwargs})
    assert e.value.param == "chat_template_kwargs" and message in e.value.message
    assert template_kwargs({}) == {} and template_kwargs({"chat_template_kwargs": {"enable_thinking": False}}) == \
        {"enable_thinking": False}


def test_reasoning_effort_is_a_template_variable():
    assert chat_template_variables({"reasoning_effort": "low"}) == {"reasoning_effort": "low"}
    assert chat_template_variables({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "high",
                                                                                         "x": 1}}) == \
        {"reasoning_effort": "high", "x": 1}
    for body, message in (({"reasoning_effort": "max"}, "must be one of none, minimal, low, medium, high"),
                          ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
                           "disagree")):
        with pytest.raises(InvalidRequest) as e:
            chat_template_variables(body)
        assert e.value.param == "reasoning_effort" and message in e.value.message


# ---- end to end ---------------------------------------------------------------------------------------------------
# DeepSeek-R1's way: the generation prompt opens the <think> block; Qwen3's enable_thinking closes it empty.
THINKING_TEMPLATE = ("{% if reasoning_effort is defined %}<system>Reasoning: {{ reasoning_effort }}\n{% endif %}"
                     "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not "
                     "enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def client(tiny_code_engine):
    openai = pytest.importorskip("openai")
    from serve_util import start_server

    server = start_server(tiny_code_engine, chat_template=THINKING_TEMPLATE, reasoning_parser="deepseek_r1")
    yield openai.OpenAI(base_url=server.http_base + "/v1", api_key="none", max_retries=0), server
    server.stop()


def test_an_answer_inside_the_opened_block_is_reasoning_whole_and_streamed(client):
    client, _ = client
    r = client.chat.completions.create(model="kiln-tiny-code", messages=MESSAGES, max_tokens=8, temperature=0)
    message = r.choices[0].message
    assert message.content is None and message.reasoning_content and r.choices[0].finish_reason == "length"
    reasoning = ""
    for chunk in client.chat.completions.create(model="kiln-tiny-code", messages=MESSAGES, max_tokens=8,
                                                temperature=0, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
    assert reasoning == message.reasoning_content


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(client):
    """enable_thinking false: the template closes the block in the prompt (more prompt tokens), so the answer is
    content; /tokenize renders the same; reasoning_effort adds its system line."""
    import json
    import urllib.request

    client, server = client
    usage = {}
    for thinking in (True, False):
        r = client.chat.completions.create(model="kiln-tiny-code", messages=MESSAGES, max_tokens=4, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
        message = r.choices[0].message
        assert (message.content is None) == thinking and bool(getattr(message, "reasoning_content", None)) == thinking
        usage[thinking] = r.usage.prompt_tokens
        request = urllib.request.Request(server.http_base + "/tokenize", data=json.dumps(
            {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": thinking}}).encode(),
            headers={"Content-Type": "application/json"})
        assert json.load(urllib.request.urlopen(request, timeout=30))["count"] == usage[thinking]
    assert usage[False] > usage[True]
    r = client.chat.completions.create(model="kiln-tiny-code", messages=MESSAGES, max_tokens=1, temperature=0,
                                       reasoning_effort="low")  # the openai package's own field
    assert r.usage.prompt_tokens > usage[True]
