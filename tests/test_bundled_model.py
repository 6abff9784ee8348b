"""The bundled trained models in examples/: what they are, that transformers loads them, and that kiln
runs them exactly as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from model_factory import hf_greedy

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM, SamplingParams

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MAIN = EXAMPLES / "kiln-tiny-code"
DRAFT = EXAMPLES / "kiln-tiny-code-draft"
PROMPTS = ["def fibonacci(n):", "import os\n\n\nclass FileCache:\n    def __init__(self, root):\n"]


def test_bundled_models_are_small_llamas_on_one_tokenizer():
    sizes = sum(f.stat().st_size for d in (MAIN, DRAFT) for f in d.iterdir())
    assert sizes < 45 * 2**20
    params = {}
    for path in (MAIN, DRAFT):
        config = json.loads((path / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
        assert config["max_position_embeddings"] == 1024
        assert config["vocab_size"] == 8192
        assert config["dtype"] == "bfloat16"
        assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 1
        assert (path / "README.md").is_file()
        training = json.loads((path / "training.json").read_text())
        params[path.name] = training["params"]
        assert training["train_time_s"] <= 8 * 60
    assert 10e6 <= params["kiln-tiny-code"] <= 20e6
    assert 2e6 <= params["kiln-tiny-code-draft"] <= 5e6
    assert (MAIN / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()


def test_tokenizer_loads_with_auto_tokenizer_and_puts_bos_first():
    tokenizer = transformers.AutoTokenizer.from_pretrained(MAIN)
    assert len(tokenizer) == 8192
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    ids = tokenizer.encode("def f(x):\n    return x\n")
    assert ids[0] == 0 and 0 not in ids[1:]
    assert tokenizer.decode(ids[1:]) == "def f(x):\n    return x\n"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("bundled")
    return {path.name: build_engine(path, root / path.name, BuildConfig(dtype="float32"), progress=False)
            for path in (MAIN, DRAFT)}


@pytest.mark.parametrize("model", [MAIN, DRAFT], ids=lambda p: p.name)
def test_greedy_tokens_equal_transformers_generate(model, engines):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    llm = LLM(engines[model.name])
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs):
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert out.token_ids == hf_greedy(hf, out.prompt_token_ids, 24), prompt


def test_the_model_writes_python(engines):
    llm = LLM(engines["kiln-tiny-code"])
    out = llm.generate("def add(a, b):", SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert out.text.startswith("\n    ")  # a function body follows, indented


# ---- the chat template both models ship (tokenizer_config.json), so chat and tools need no --chat-template ----
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_both_models_ship_one_chatml_template_with_bos_first():
    templates = {path.name: json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
                 for path in (MAIN, DRAFT)}
    assert templates["kiln-tiny-code"] == templates["kiln-tiny-code-draft"]
    source = EXAMPLES.parent / "scripts" / "tiny_chat_template.jinja"  # what scripts/train_tiny.py writes there
    assert templates["kiln-tiny-code"] == source.read_text(encoding="utf-8").rstrip("\n")
    tokenizer = transformers.AutoTokenizer.from_pretrained(MAIN)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|bos|><|im_start|>system\nYou write Python.<|eos|>\n<|im_start|>user\nSort a list.<|eos|>\n"
                    "<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)  # as kiln serve encodes it: the template put BOS first
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(tokenizer.eos_token_id) == 2  # each turn ends with the token generation stops at
    # plain prompts tokenize as before the template was added (the README's `kiln generate` is unchanged)
    assert tokenizer.encode(PROMPTS[0]) == [0, *tokenizer.encode(PROMPTS[0], add_special_tokens=False)]


def test_the_template_renders_tools_and_earlier_calls_in_the_llama3_json_format():
    """Llama architecture: kiln serve reads and constrains tool calls as llama3_json; the template shows the
    tools and the answer format, and renders earlier calls so that the parser reads them back."""
    from kiln.serve.openai.tool_calls import Llama3JsonParser, default_parser
    from kiln.serve.openai.tool_specs import check_tools

    assert default_parser("LlamaForCausalLM") == "llama3_json"
    tokenizer = transformers.AutoTokenizer.from_pretrained(MAIN)
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
             for i, city in enumerate(("Paris", "Rome"))]
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c0", "content": "sunny"}]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|bos|><|im_start|>system\nYou may call these functions:\n"
                           + json.dumps(WEATHER["function"]) + '\nTo call one, answer with nothing but {"name": ')
    assert "<|im_start|>tool\nsunny<|eos|>\n" in text and text.endswith("<|im_start|>assistant\n")
    earlier = text.split("<|im_start|>assistant\n")[1].split("<|eos|>")[0]
    parsed = Llama3JsonParser().parse(earlier, check_tools([WEATHER]))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"}),
                                                                         ("get_weather", {"city": "Rome"})]


def test_kiln_build_copies_the_template_into_the_engine(engines):
    for path in (MAIN, DRAFT):
        shipped = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
        assert LLM(engines[path.name]).tokenizer.chat_template == shipped
