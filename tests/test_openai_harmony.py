"""GPT-OSS's harmony format in /v1/chat/completions (serve/openai/harmony.py): the parser on hand-written answers,
whole and streamed in random chunkings, the constraint for a forced call, and end to end through `kiln serve` with
the `openai` client on a tiny random GPT-OSS whose tokenizer has the harmony special tokens and a harmony chat
template. A random model does not write harmony: guided decoding (a grammar that spells the answer) or a logit bias
steers it."""

from __future__ import annotations

import json
import random
import urllib.request

import pytest
from tokenizer_factory import make_test_tokenizer

from kiln.runtime.core.sampling_params import SamplingParams
from kiln.serve.openai.chat import answer_output, chat_messages
from kiln.serve.openai.harmony import HarmonyOutput, read_messages
from kiln.serve.openai.tool_calls import HARMONY, default_parser
from kiln.serve.openai.tool_specs import ToolChoice, check_tool_choice, check_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOLS = check_tools([WEATHER, ADD])
AUTO = check_tool_choice(None, TOOLS)
SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

ANSWER = "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>Hi <b>!"
CALL = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
# recipient in the header before the channel, a preamble, two calls, whitespace around the arguments
TWO_CALLS = ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.add<|channel|>'
             'commentary json<|message|> {"a": 1, "b": 2}\n<|call|><|start|>assistant<|channel|>commentary '
             'to=functions.get_weather<|constrain|>json<|message|>{"city": "Rome"}')


class _Vocab:
    """A tokenizer stand-in: only its vocabulary is read."""

    def get_vocab(self) -> dict:
        return {token: 400 + i for i, token in enumerate(SPECIALS)}


def output(choice: ToolChoice = AUTO) -> HarmonyOutput:
    return HarmonyOutput(_Vocab(), choice)


# ---- the parser -------------------------------------------------------------------------------------------------
def test_reasoning_and_final_answer():
    message, finish = output().message(ANSWER + "<|return|>", "stop")
    assert message == {"role": "assistant", "content": "Hi <b>!", "reasoning_content": "The user greets.",
                       "reasoning": "The user greets."}
    assert finish == "stop"


def test_a_tool_call_with_its_reasoning():
    message, finish = output().message(CALL, "stop")
    assert message["content"] is None and message["reasoning_content"] == "Need weather."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert finish == "tool_calls"


def test_two_calls_a_preamble_and_the_recipient_before_the_channel():
    message, finish = output().message(TWO_CALLS, "stop")  # the last <|call|> was a stop token: not in the text
    assert message["content"] == "Checking." and message["reasoning_content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "add", "arguments": '{"a": 1, "b": 2}'},
                                                              {"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    assert finish == "tool_calls"


def test_a_call_cut_off_keeps_its_finish_reason():
    message, finish = output().message(CALL[:-len('"}<|call|>')], "length")
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris' and finish == "length"


def test_calls_the_request_cannot_take_are_content():
    """tool_choice "none" (no tools) or a function the request does not offer: the body is content, no call."""
    for choice in (ToolChoice("none"), check_tool_choice(None, check_tools([ADD]))):
        message, finish = output(choice).message(CALL, "stop")
        assert "tool_calls" not in message and message["content"] == '{"city": "Paris"}' and finish == "stop"


def test_text_that_is_not_harmony_is_content():
    assert output().message("just text", "length")[0]["content"] == "just text"
    assert output().message("", "length")[0]["content"] == ""
    messages, loose = read_messages("<|channel|>final<|message|>a<|end|><|start|>assistant<|chan")
    assert [m.body for m in messages] == ["a"] and loose == ""  # a header cut off is markup, not text


def _split(text: str, rng: random.Random) -> list[int]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
    return cuts + [len(text)]


def _assemble(choice: ToolChoice, text: str, cuts: list[int], finish_reason: str) -> tuple[dict, str]:
    """Streams `text` cut at `cuts`; -> (the message the deltas add up to, the finish reason sent)."""
    stream = output(choice).stream()
    reasoning, content, calls, sent_finish = "", "", {}, None
    for k, cut in enumerate(cuts):
        finished = k == len(cuts) - 1
        deltas, finish = stream.deltas(text[:cut], finished, finish_reason if finished else None)
        assert finish is None or finished
        sent_finish = finish
        for d in deltas:
            assert d and all(v for v in d.values())  # no empty deltas
            reasoning += d.get("reasoning_content", "")
            content += d.get("content", "")
            for call in d.get("tool_calls", []):
                entry = calls.setdefault(call["index"], {"id": call.get("id"), "name": "", "arguments": ""})
                assert ("id" in call) == (entry["name"] == "")  # the id and name come once, first
                entry["name"] += call["function"].get("name", "")
                entry["arguments"] += call["function"]["arguments"]
        assert all(marker not in reasoning + content for marker in SPECIALS)
    return {"reasoning": reasoning, "content": content, "calls": [calls[i] for i in sorted(calls)]}, sent_finish


@pytest.mark.parametrize("text", [ANSWER + "<|return|>", ANSWER, CALL, TWO_CALLS, "plain <|text"])
def test_streaming_in_any_chunking_adds_up_to_the_whole_answer(text):
    whole, finish = output().message(text, "stop")
    expected = {"reasoning": whole["reasoning_content"] or "", "content": whole["content"] or "",
                "calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                          for c in whole.get("tool_calls", [])]}
    rng = random.Random(0)
    for cuts in [[len(text)], list(range(1, len(text) + 1))] + [_split(text, rng) for _ in range(40)]:
        got, sent_finish = _assemble(AUTO, text, cuts, "stop")
        assert all(c.pop("id").startswith("call_") for c in got["calls"])
        assert got == expected, cuts
        assert sent_finish == finish


def test_streaming_sends_text_as_it_comes():
    stream = output().stream()
    deltas, _ = stream.deltas("<|channel|>analysis<|message|>Thinking ab", False, None)
    assert deltas == [{"reasoning_content": "Thinking ab", "reasoning": "Thinking ab"}]
    deltas, _ = stream.deltas("<|channel|>analysis<|message|>Thinking about it<|", False, None)  # a marker starts
    assert deltas == [{"reasoning_content": "out it", "reasoning": "out it"}]
    text = CALL[:CALL.index('"Paris"')]
    deltas, _ = output().stream().deltas(text, False, None)
    assert deltas[-2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[-1]["tool_calls"][0]["function"] == {"arguments": '{"city": '[:-1]}  # the space is held


# ---- choosing the format, the request side ----------------------------------------------------------------------
def test_harmony_is_chosen_by_architecture_or_template():
    assert default_parser("GptOssForCausalLM") == HARMONY
    assert default_parser("LlamaForCausalLM", "{{ '<|start|>assistant<|channel|>final' }}") == HARMONY
    assert default_parser("LlamaForCausalLM", "{{ messages }}") == "llama3_json"
    assert isinstance(answer_output(HARMONY, ToolChoice("none"), _Vocab()), HarmonyOutput)  # read without tools
    assert answer_output("hermes", ToolChoice("none"), _Vocab()) is None


def test_harmony_requests_keep_special_tokens_and_stop_at_call_and_return():
    params = output().sampling_params(SamplingParams(stop_token_ids=[7, 406]))
    assert params.skip_special_tokens is False and params.stop_token_ids == (7, 406, 405)


def test_reasoning_content_reaches_the_template_as_thinking():
    [message] = chat_messages([{"role": "assistant", "content": None, "reasoning_content": "hm", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}])
    assert message["thinking"] == "hm" and message["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_the_forced_call_constraint_takes_harmony_calls_only():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_ebnf(output(check_tool_choice("required", TOOLS)).constraint().grammar)
    assert _is_grammar_accept_string(grammar, CALL)
    assert _is_grammar_accept_string(grammar, CALL[CALL.index("<|start|>") + len("<|start|>assistant"):])
    assert _is_grammar_accept_string(grammar, '<|channel|>commentary to=functions.add <|constrain|>json<|message|>'
                                              '{"a": 1, "b": 2}<|call|>')
    assert not _is_grammar_accept_string(grammar, CALL.replace("Paris", "Oslo"))
    assert not _is_grammar_accept_string(grammar, ANSWER)
    named = xgr.Grammar.from_ebnf(output(check_tool_choice({"type": "function", "function": {"name": "add"}},
                                                           TOOLS)).constraint().grammar)
    assert not _is_grammar_accept_string(named, CALL)


# ---- end to end -------------------------------------------------------------------------------------------------
# A harmony chat template shaped like GPT-OSS's own (system, developer with the tools, the turns, analysis before
# calls, tool results from functions.NAME), shortened.
TEMPLATE = """<|start|>system<|message|>Reasoning: low
# Valid channels: analysis, commentary, final.
{%- if tools %} Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- if tools %}<|start|>developer<|message|># Tools
namespace functions {
{%- for t in tools %}
// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{%- endfor %}
} // namespace functions<|end|>
{%- endif %}
{%- set ns = namespace(last="") %}
{%- for m in messages %}
{%- if m.role == "user" or m.role == "system" %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- elif m.role == "assistant" %}
{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}
{%- if m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant to=functions.{{ c.function.name }}<|channel|>\
commentary json<|message|>{{ c.function.arguments | tojson }}<|call|>{% set ns.last = c.function.name %}{% endfor %}
{%- elif m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}
{%- elif m.role == "tool" %}<|start|>functions.{{ ns.last }} to=assistant<|channel|>commentary<|message|>\
{{ m.content | tojson }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""
MESSAGES = [{"role": "user", "content": "the cat"}]
VOCAB = 416  # the test tokenizer's 400 tokens, the 7 harmony tokens, room


def _literal(text: str) -> str:
    return f"root ::= {json.dumps(text)}"


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    import torch
    import transformers
    from model_factory import BASE
    from serve_util import start_server
    from test_models_gpt_oss import CONFIG

    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    tmp = tmp_path_factory.mktemp("harmony")
    config = transformers.GptOssConfig(**{**BASE, **CONFIG, "vocab_size": VOCAB,
                                                      "max_position_embeddings": 1024})
    config.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(config).save_pretrained(tmp / "ckpt")
    tokenizer = make_test_tokenizer(tmp / "ckpt")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(tmp / "ckpt")
    engine = build_engine(tmp / "ckpt", tmp / "engine", BuildConfig(dtype="float32", max_batch_size=4,
                                                                   max_num_tokens=512, max_seq_len=1024),
                          progress=False)
    server = start_server(engine, chat_template=None)  # the engine's own template: harmony
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(harmony_server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=harmony_server.http_base + "/v1", api_key="none", max_retries=0)


def _stream(client, **kwargs) -> tuple[str, str, dict, str]:
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model="kiln-tiny-code", stream=True, temperature=0, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_reasoning_and_answer_through_the_openai_client(client, harmony_server):
    grammar = _literal("<|channel|>analysis<|message|>the cat sees<|end|><|start|>assistant<|channel|>final"
                       "<|message|>an apple.<|return|>")
    r = client.chat.completions.create(model="kiln-tiny-code", messages=MESSAGES, max_tokens=200, temperature=0,
                                       extra_body={"guided_grammar": grammar})
    message = r.choices[0].message
    assert message.content == "an apple." and message.reasoning_content == "the cat sees"
    assert r.choices[0].finish_reason == "stop" and not message.tool_calls
    tokenizer = harmony_server.service.tokenizer
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tokenizer.encode(rendered))  # with BOS
    reasoning, content, calls, finish = _stream(client, messages=MESSAGES, max_tokens=200,
                                                extra_body={"guided_grammar": grammar})
    assert (reasoning, content, calls, finish) == ("the cat sees", "an apple.", {}, "stop")


def test_a_tool_call_through_the_openai_client(client):
    grammar = _literal('<|channel|>analysis<|message|>we sees<|end|><|start|>assistant<|channel|>commentary '
                       'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>')
    kwargs = dict(messages=MESSAGES, max_tokens=300, tools=[WEATHER, ADD], extra_body={"guided_grammar": grammar})
    r = client.chat.completions.create(model="kiln-tiny-code", temperature=0, **kwargs)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.reasoning_content == "we sees"
    [call] = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome"}
    reasoning, content, calls, finish = _stream(client, **kwargs)
    assert reasoning == "we sees" and content == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Rome"})]
    assert calls[0]["id"].startswith("call_")


def test_tool_choice_required_constrains_the_model_to_a_call(client, harmony_server):
    """The constraint lets the model reason first or call at once; a bias against tokens that start with "a"
    (analysis) takes the call branch."""
    vocab = harmony_server.service.tokenizer.get_vocab()
    bias = {str(i): -100 for token, i in vocab.items() if token.startswith("a")}
    r = client.chat.completions.create(model="kiln-tiny-code", messages=MESSAGES, max_tokens=300, temperature=0,
                                       tools=[WEATHER, ADD], tool_choice="required", logit_bias=bias)
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name in ("get_weather", "add")
    assert isinstance(json.loads(call.function.arguments), dict)
    r = client.chat.completions.create(model="kiln-tiny-code", messages=MESSAGES, max_tokens=300, temperature=0,
                                       tools=[WEATHER, ADD], logit_bias=bias,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_earlier_calls_reasoning_and_tool_results_go_back_through_the_template(client, harmony_server):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "reasoning_content": "need it", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="kiln-tiny-code", messages=history, max_tokens=2, temperature=0,
                                       tools=[WEATHER])
    tokenizer = harmony_server.service.tokenizer
    rendered = tokenizer.apply_chat_template(chat_messages(history), tools=[WEATHER], add_generation_prompt=True,
                                             tokenize=False)
    assert ('<|start|>assistant<|channel|>analysis<|message|>need it<|end|><|start|>assistant '
            'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>') in rendered
    assert r.usage.prompt_tokens == len(tokenizer.encode(rendered))  # with BOS


def test_completions_and_kserve_return_the_raw_text(harmony_server):
    """Only chat reads harmony: /v1/completions (with skip_special_tokens false: the whole text) and KServe's
    generate (special tokens skipped, as Triton's postprocessing does) give the text as generated."""
    raw = "<|channel|>final<|message|>an apple.<|return|>"
    body = {"model": "kiln-tiny-code", "prompt": "the cat", "max_tokens": 40, "temperature": 0,
            "guided_grammar": _literal(raw), "skip_special_tokens": False, "include_stop_str_in_output": True}
    request = urllib.request.Request(harmony_server.http_base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.loads(response.read())["choices"][0]["text"] == raw
    body = {"text_input": "the cat", "max_tokens": 40, "guided_decoding_guide_type": "ebnf_grammar",
            "guided_decoding_guide": _literal(raw), "exclude_input_in_output": True}
    request = urllib.request.Request(harmony_server.http_base + "/v2/models/kiln-tiny-code/generate",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        text = json.loads(response.read())["text_output"]
    # the grammar's markers come as special tokens (skipped) or as plain characters (kept): either way, no parsing
    for marker in SPECIALS:
        text = text.replace(marker, "")
    assert text == "finalan apple."
