"""Bad words, word lists and logit bias (issue 35, item 2) on the bundled kiln-tiny-code in float32: bad words
never appear in a thousand sampled completions built to provoke them; greedy output with bad words equals
transformers' generate(bad_words_ids=...) and with logit_bias its generate(sequence_bias=...); multi-token stop
sequences end the text; bad values are ValueErrors naming the field. The text layer (a word that tokenizes
differently in context) is checked on the mask itself (runtime/core/bad_words.py)."""

from __future__ import annotations

import re

import pytest
import torch
from serve_util import EXAMPLES

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.core.bad_words import has_inner_occurrence, sequence_bans, text_ban_prefixes
from kiln.runtime.sampling.bad_words import WordBans
from kiln.runtime.sampling.logit_bias import apply_logit_bias
from kiln.runtime.sampling.sampler import SamplingRow

CHECKPOINT = EXAMPLES / "kiln-tiny-code"
# Its continuations start with " def" nearly always (244 of 250 sampled).
DEF_PROMPT = "class Stack:\n    def __init__(self):\n        self.items = []\n\n   "
PROMPTS = [DEF_PROMPT, "def fibonacci(n):", "    def pop(self):\n        ", "import os\n\n"]


def occurs(word: str, text: str) -> bool:
    """The guarantee's notion of an occurrence: `word` where it starts a word (it starts with a word char)."""
    pattern = (r"(?<!\w)" if re.match(r"\w", word) else "") + re.escape(word)
    return re.search(pattern, text) is not None


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    """kiln-tiny-code in float32 with room for 250 requests a step."""
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    return build_engine(CHECKPOINT, tmp_path_factory.mktemp("bad-words") / "engine",
                        BuildConfig(dtype="float32", max_batch_size=256, max_num_tokens=1024), progress=False)


@pytest.fixture(scope="module")
def llm(engine_dir):
    llm = LLM(engine_dir)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINT)
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()
    return model, tokenizer


def hf_greedy(hf, prompt: str, max_tokens: int, **kwargs) -> list[int]:
    model, tokenizer = hf
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, **kwargs)[0, ids.shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    return out[:out.index(eos)] if eos in out else out  # kiln leaves EOS out of token_ids


# ---- the rules (plain Python) ---------------------------------------------------------------------------------
def test_text_layer_rules():
    assert text_ban_prefixes("def", "x = ") == ["def"]
    assert text_ban_prefixes("def", "x = de") == ["f"]  # "de" ends the text at a word start
    assert text_ban_prefixes("def", "x = unde") == []  # "unde" ends in no word start
    assert text_ban_prefixes("def", "(") == ["def"]
    assert text_ban_prefixes(" def", "a") == [" def"]  # no boundary needed for a word that starts with a space
    assert text_ban_prefixes("def", "") == ["def"]
    assert has_inner_occurrence("def", "(default") and not has_inner_occurrence("def", "undefined")
    assert not has_inner_occurrence("def", "def")  # at the start: text_ban_prefixes' case
    assert sequence_bans([(5,), (7, 8, 9)], [1, 7, 8]) == {5, 9}
    assert sequence_bans([(7, 8, 9)], [7, 8, 1]) == set()


def test_mask_catches_other_tokenizations(hf):
    """After " de" (a word start), every token whose text starts with "f" is banned, though "def" is one token
    (" def" another) in this tokenizer; after "unde" none is."""
    _, tokenizer = hf
    bans = WordBans(tokenizer, 8192, (1,))
    params = SamplingParams(bad_words=["def"])
    bans.prepare(params)

    def banned(context: str) -> set[int]:
        row = SamplingRow(params, tokenizer.encode(context, add_special_tokens=False), [])
        mask = bans.apply(None, [row], 8192, torch.device("cpu"))
        return set(torch.nonzero(~mask[0]).flatten().tolist())

    texts = {i: tokenizer.decode([0, i])[len(tokenizer.decode([0])):] for i in range(8192)}
    after_de = banned("x = de")
    assert {i for i, t in texts.items() if t.startswith("f")} <= after_de
    assert {322, 367} <= after_de  # "def", " def": vLLM's two tokenizations
    after_unde = banned("x = unde")
    assert not any(texts[i].startswith("f") for i in after_unde) and 367 in after_unde


# ---- through the engine ---------------------------------------------------------------------------------------
@pytest.mark.slow  # 1000 x 3 tokens through the CPU reference attention: ~60 s on the shared 2-core dev machine
def test_bad_words_never_appear_in_a_thousand_sampled_completions(llm):
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    control = llm.generate([DEF_PROMPT] * 32, params)
    assert sum(occurs("def", o.text) for o in control) > 24  # the prompt does provoke "def"
    banned = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, bad_words=["def"])
    outs = [o for _ in range(4) for o in llm.generate([DEF_PROMPT] * 250, banned)]
    assert len(outs) == 1000
    assert not [o.text for o in outs if occurs("def", o.text)]
    assert len({o.text for o in outs}) > 100  # still sampled


@pytest.mark.parametrize("words", [["def"], ["return", "self"]])
def test_greedy_equals_transformers_bad_words_ids(llm, hf, words):
    _, tokenizer = hf
    bad_ids = [tokenizer.encode(text, add_special_tokens=False) for w in words for text in (w, " " + w)]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, bad_words=words))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10, bad_words_ids=bad_ids), prompt
        assert not any(occurs(w, out.text) for w in words)


def test_bad_words_token_ids_equal_transformers(llm, hf):
    _, tokenizer = hf
    plain = llm.generate(DEF_PROMPT, SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    sequence = plain[:3]  # the greedy start itself: banned as a sequence, its last token goes
    out = llm.generate(DEF_PROMPT, SamplingParams(max_tokens=8, temperature=0, bad_words_token_ids=[sequence]))[0]
    assert out.token_ids == hf_greedy(hf, DEF_PROMPT, 8, bad_words_ids=[sequence])
    assert out.token_ids[:3] != sequence


def test_logit_bias_equals_transformers_sequence_bias(llm, hf):
    bias = {292: 4.0, 367: -6.0, 360: 3.5}  # "self" up, " def" down, " return" up
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, logit_bias=bias))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10, sequence_bias={(t,): b for t, b in bias.items()}), prompt
    forced = llm.generate(DEF_PROMPT, SamplingParams(max_tokens=5, temperature=0.8, seed=1, logit_bias={292: 100}))
    assert forced[0].token_ids == [292] * 5


def test_logit_bias_adds_to_the_logits():
    logits = torch.randn(3, 10)
    rows = [SamplingRow(SamplingParams(logit_bias={1: 2.0, 9: -1.5}), [], []), SamplingRow(SamplingParams(), [], []),
            SamplingRow(SamplingParams(logit_bias={0: 0.5}), [], [])]
    expected = logits.clone()
    expected[0, 1] += 2.0
    expected[0, 9] -= 1.5
    expected[2, 0] += 0.5
    assert torch.equal(apply_logit_bias(logits, rows), expected)
    assert apply_logit_bias(logits, rows[1:2]) is logits  # no bias: no copy


def test_stop_token_sequences(llm, hf):
    _, tokenizer = hf
    plain = llm.generate(DEF_PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    sequence = plain.token_ids[3:5]  # two tokens in the middle: their text becomes a stop string
    out = llm.generate(DEF_PROMPT, SamplingParams(max_tokens=12, temperature=0, stop_token_sequences=[sequence]))[0]
    assert out.finish_reason == "stop" and out.text == plain.text[:plain.text.index(tokenizer.decode(sequence))]
    one = llm.generate(DEF_PROMPT, SamplingParams(max_tokens=12, temperature=0,
                                                  stop_token_sequences=[plain.token_ids[2:3]]))[0]
    assert one.finish_reason == "stop" and one.token_ids == plain.token_ids[:3]  # the stop id ends it, no text


@pytest.mark.parametrize("kwargs, field", [
    (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=["x"] * 257), "bad_words"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[1, -2]]), "bad_words_token_ids"),
    (dict(stop_token_sequences=[5]), "stop_token_sequences"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(use_beam_search=True, n=2, bad_words=["def"]), "bad_words"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={8192: 1.0}), "logit_bias"),
    (dict(bad_words_token_ids=[[5, 9000]]), "bad_words_token_ids"),
    (dict(stop_token_sequences=[[9000]]), "stop_token_sequences"),
])
def test_token_ids_beyond_the_vocabulary_are_refused(llm, kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*vocabulary size 8192"):
        llm.generate("x", SamplingParams(max_tokens=2, **kwargs))
    assert llm.kv_cache_stats()["num_running"] == 0
