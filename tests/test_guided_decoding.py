"""Guided decoding (structured output) with xgrammar: the constraint type, the grammar compiler, the masker,
and whole-engine runs of the bundled kiln-tiny-code on the CPU."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time

import pytest
import torch

from kiln.runtime import LLM, GuidedDecoding, SamplingParams
from kiln.runtime.engine.factory import create_engine
from kiln.runtime.options import RuntimeOptions

xgr = pytest.importorskip("xgrammar")

from kiln.runtime.core.request_failure import RequestFailed  # noqa: E402
from kiln.runtime.sampling.grammar_compiler import GrammarCompiler, GrammarCompilerConfig, GrammarError  # noqa: E402
from kiln.runtime.sampling.guided_masker import GuidedMasker  # noqa: E402
from kiln.runtime.sampling.sampler import SamplingRow  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ("yes", "no", "maybe")
GRAMMAR = 'root ::= "def " name "(" name? "):"\nname ::= [a-z_] [a-z_0-9]*'
GRAMMAR_RE = r"def [a-z_][a-z_0-9]*\(([a-z_][a-z_0-9]*)?\):"
PROMPTS = ["def main():\n    x = ", "import os\n", "class A:\n    ", "# config\nvalues = "]
EOS = 1  # kiln-tiny-code's <|eos|>


def _check_schema(text: str) -> None:
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"name", "n"}, text
    assert isinstance(value["name"], str) and len(value["name"]) <= 8, text
    assert isinstance(value["n"], int) and not isinstance(value["n"], bool), text


def _check_json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


CONSTRAINTS = {
    "json": (GuidedDecoding(json=SCHEMA), _check_schema),
    "json_object": (GuidedDecoding(json_object=True), _check_json_object),
    "regex": (GuidedDecoding(regex=REGEX), lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
    "choice": (GuidedDecoding(choice=list(CHOICES)), lambda text: text in CHOICES or pytest.fail(text)),
    "grammar": (GuidedDecoding(grammar=GRAMMAR), lambda text: re.fullmatch(GRAMMAR_RE, text) or pytest.fail(text)),
}


def _check(kind: str, out) -> None:
    """A finished constrained output matches its constraint; one cut by max_tokens is at least a prefix."""
    if out.finish_reason == "stop":
        CONSTRAINTS[kind][1](out.text)
    else:
        assert out.finish_reason == "length"
        matcher = xgr.GrammarMatcher(_compiler().compile(CONSTRAINTS[kind][0]))
        assert all(matcher.accept_token(t) for t in out.token_ids), out.text


_COMPILER: list[GrammarCompiler] = []


def _compiler_tokenizer():
    from serve_util import EXAMPLES
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(EXAMPLES / "kiln-tiny-code")


def _compiler() -> GrammarCompiler:
    if not _COMPILER:
        _COMPILER.append(GrammarCompiler(_compiler_tokenizer(), 8192, [EOS]))
    return _COMPILER[0]


@pytest.fixture(scope="module")
def llm(tiny_code_engine):
    return LLM(tiny_code_engine)


def _assert_all_free(llm_or_engine) -> None:
    stats = llm_or_engine.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0


# ---- GuidedDecoding ----------------------------------------------------------------------------
def test_guided_decoding_kind_and_key():
    assert GuidedDecoding(json=SCHEMA).kind == "json"
    assert GuidedDecoding(json_object=True).kind == "json_object"
    assert GuidedDecoding(regex="a+").kind == "regex"
    assert GuidedDecoding(grammar='root ::= "a"').kind == "grammar"
    choice = GuidedDecoding(choice=["a", "b"])
    assert choice.kind == "choice" and choice.choice == ("a", "b") and choice == GuidedDecoding(choice=("a", "b"))
    # The same schema as a dict or as JSON text (any spacing) is the same cache key; a different one is not.
    assert GuidedDecoding(json=SCHEMA).key() == GuidedDecoding(json=json.dumps(SCHEMA, indent=2)).key()
    assert GuidedDecoding(json=SCHEMA).key() != GuidedDecoding(json={"type": "object"}).key()
    assert GuidedDecoding(regex="a").key() != GuidedDecoding(grammar="a").key()
    hash(SamplingParams(guided_decoding=GuidedDecoding(json=SCHEMA)))  # a dict inside, still hashable


@pytest.mark.parametrize("kwargs, message", [
    ({}, "guided_decoding must set exactly one of json, json_object, regex, grammar, choice (got: none)"),
    ({"regex": "a", "choice": ["a"]}, "(got: regex, choice)"),
    ({"json": SCHEMA, "json_object": True}, "(got: json, json_object)"),
    ({"json": 3}, "guided_decoding.json=3 is invalid: must be a JSON schema"),
    ({"json": "{not json"}, "guided_decoding.json='{not json' is invalid: not valid JSON text"),
    ({"json": "[1, 2]"}, "guided_decoding.json='[1, 2]' is invalid: a JSON schema must be an object"),
    ({"json_object": 1}, "guided_decoding.json_object=1 is invalid: must be True or False"),
    ({"regex": ""}, "guided_decoding.regex='' is invalid: must be a non-empty string"),
    ({"regex": 5}, "guided_decoding.regex=5 is invalid"),
    ({"grammar": b"root"}, "guided_decoding.grammar=b'root' is invalid"),
    ({"choice": "yes"}, "guided_decoding.choice='yes' is invalid: must be a list of strings"),
    ({"choice": []}, "guided_decoding.choice=() is invalid: must list at least one string"),
    ({"choice": ["a", ""]}, "guided_decoding.choice=('a', '') is invalid: must be non-empty strings"),
    ({"choice": ["a", 1]}, "is invalid: must be non-empty strings"),
])
def test_guided_decoding_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError) as info:
        GuidedDecoding(**kwargs)
    assert message in str(info.value)


def test_sampling_params_checks_the_guided_decoding_type():
    with pytest.raises(ValueError, match="SamplingParams.guided_decoding"):
        SamplingParams(guided_decoding={"json": SCHEMA})


# ---- the compiler --------------------------------------------------------------------------------
def test_compiler_caches_by_key_and_names_the_field_in_errors():
    compiler = _compiler()
    assert compiler.compile(GuidedDecoding(json=SCHEMA)) is compiler.compile(GuidedDecoding(json=json.dumps(SCHEMA)))
    bad = {
        GuidedDecoding(json={"type": "integer", "minimum": 5, "maximum": 1}):
            "guided_decoding.json: invalid JSON schema: Invalid range: minimum greater than maximum",
        GuidedDecoding(regex="[a-"): "guided_decoding.regex: invalid regex: Regex parsing error at position 4",
        GuidedDecoding(grammar='root ::= "a" | undefined'): "guided_decoding.grammar: invalid EBNF grammar: ",
    }
    for guided, message in bad.items():
        for _ in range(2):  # the second answer comes from the cache
            with pytest.raises(GrammarError) as info:
                compiler.compile(guided)
            assert str(info.value).startswith(message) and "/project/cpp" not in str(info.value)
            assert isinstance(info.value, ValueError)


def test_choice_strings_are_escaped():
    choices = ['a"b', "back\\slash", "new\nline", "[x]*"]
    grammar = _compiler().compile(GuidedDecoding(choice=choices))
    for c in choices:
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string(c) and matcher.is_completed()
    assert not xgr.GrammarMatcher(grammar).accept_string("xx")


def test_json_object_allows_any_object_but_nothing_else():
    grammar = _compiler().compile(GuidedDecoding(json_object=True))
    assert xgr.GrammarMatcher(grammar).accept_string('{"a": [1, {"b": null}], "c": "x"}')
    assert not xgr.GrammarMatcher(grammar).accept_string("[1]")


def test_a_constraint_slower_than_the_limit_is_refused_and_remembered():
    compiler = GrammarCompiler(_compiler_tokenizer(), 8192, [EOS],
                               GrammarCompilerConfig(max_grammar_compile_seconds=0.05, max_concurrent_compiles=1))
    # About 0.2 s to compile here: nested objects whose string properties have patterns.
    slow = {"type": "object", "properties": {
        f"p{i}": {"type": "object", "properties": {f"q{j}": {"type": "string", "pattern": "[a-z]{2,40}"}
                                                   for j in range(10)}} for i in range(3)}}
    with pytest.raises(GrammarError, match=r"guided_decoding.json: the constraint took longer than 0.05 s to "
                                           r"compile \(max_grammar_compile_seconds\)"):
        compiler.compile(GuidedDecoding(json=slow))
    start = time.perf_counter()
    with pytest.raises(GrammarError, match="took longer"):
        compiler.compile(GuidedDecoding(json=slow))
    assert time.perf_counter() - start < 0.01  # refused from the cache, not compiled again
    # The slow compilation's worker process was killed at the limit: the only slot is free at once.
    assert compiler.compile(GuidedDecoding(regex="[0-9]+")) is not None
    compiler.close()


# ---- the masker ----------------------------------------------------------------------------------
def _row() -> SamplingRow:
    return SamplingRow(SamplingParams(), [0], [])


def test_masker_masks_only_constrained_rows_and_disallows_ids_past_the_tokenizer():
    masker = GuidedMasker(_compiler())
    masker.add_request("c", GuidedDecoding(regex="[0-9]+"))
    assert masker.token_mask(["u1", "u2"], [_row(), _row()], 8192, torch.device("cpu")) is None
    mask = masker.token_mask(["u1", "c", "u2"], [_row()] * 3, 8192 + 64, torch.device("cpu"))
    assert mask.shape == (3, 8192 + 64) and mask.dtype == torch.bool
    assert mask[0].all() and mask[2].all()
    allowed = mask[1].nonzero().flatten().tolist()
    tokenizer = _compiler_tokenizer()
    assert allowed and all(t < 8192 and tokenizer.decode([t]).isdigit() for t in allowed)
    assert not mask[1, EOS]  # nothing accepted yet: the regex cannot end
    digit = allowed[0]
    assert masker.accept("c", [digit]) is False
    assert masker.token_mask(["c"], [_row()], 8192, torch.device("cpu"))[0, EOS]  # now it may end
    assert masker.accept("c", [EOS]) is True  # terminated: the engine ends the request
    masker.rollback("c", 1)
    letter = tokenizer.encode("abc")[-1]
    with pytest.raises(RequestFailed, match=f"sampled token {letter}, which the constraint does not allow") as info:
        masker.accept("c", [letter])
    assert info.value.request_id == "c"  # that request fails alone
    masker.release("c")
    assert "c" not in masker and len(masker) == 0
    assert masker.accept("c", [letter]) is False  # unknown requests are unconstrained


def test_batch_bitmask_fill_equals_one_by_one():
    masker = GuidedMasker(_compiler())
    kinds = list(CONSTRAINTS)
    ids = [f"r{i}" for i in range(16)]
    for i, request_id in enumerate(ids):
        masker.add_request(request_id, CONSTRAINTS[kinds[i % len(kinds)]][0])
    batched = masker.token_mask(ids, [_row()] * 16, 8192, torch.device("cpu"))  # the thread-pool path
    single = torch.cat([masker.token_mask([r], [_row()], 8192, torch.device("cpu")) for r in ids])
    assert torch.equal(batched, single)


# ---- whole-engine runs -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_outputs_match_their_constraint_greedy_and_seeded(llm, kind):
    guided = CONSTRAINTS[kind][0]
    params = [SamplingParams(max_tokens=40, temperature=0, guided_decoding=guided)] + [
        SamplingParams(max_tokens=40, temperature=1.0, seed=seed, guided_decoding=guided) for seed in (1, 2, 3)]
    outputs = llm.generate(PROMPTS, params)
    for out in outputs:
        _check(kind, out)
    # Greedy ends within max_tokens for every kind; so do most seeded runs (the rest are cut mid-way).
    assert outputs[0].finish_reason == "stop"
    assert sum(out.finish_reason == "stop" for out in outputs) >= 3
    # A seeded request is reproducible.
    assert llm.generate(PROMPTS[1], params[1])[0].token_ids == outputs[1].token_ids
    _assert_all_free(llm)


def test_32_mixed_requests_leave_unconstrained_ones_unchanged(llm):
    kinds = list(CONSTRAINTS)
    prompts, params, guided_kinds = [], [], []
    for i in range(32):
        prompts.append(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)))
        sampling = {"temperature": 0} if i % 3 else {"temperature": 0.8, "seed": 100 + i}
        kind = kinds[(i // 2) % len(kinds)] if i % 2 else None
        guided_kinds.append(kind)
        params.append(SamplingParams(max_tokens=24, guided_decoding=CONSTRAINTS[kind][0] if kind else None,
                                     **sampling))
    mixed = llm.generate(prompts, params)
    plain = [i for i, kind in enumerate(guided_kinds) if kind is None]
    constrained = [i for i, kind in enumerate(guided_kinds) if kind is not None]
    alone = llm.generate([prompts[i] for i in plain], [params[i] for i in plain])
    for i, out in zip(plain, alone):
        assert mixed[i].token_ids == out.token_ids, f"request {i}"
    only_constrained = llm.generate([prompts[i] for i in constrained], [params[i] for i in constrained])
    for i, out in zip(constrained, only_constrained):
        assert mixed[i].token_ids == out.token_ids, f"request {i}"
        _check(guided_kinds[i], mixed[i])
    _assert_all_free(llm)


def test_preempted_constrained_requests_stay_valid(tiny_code_engine, llm):
    # Long outputs, so the running requests outgrow 8 blocks of 16 tokens and are preempted and recomputed.
    regex = r"([a-z]-[0-9],){8}"
    kinds = ["json_object", "regex", "json", "grammar"] * 2
    guided = [GuidedDecoding(regex=regex) if k == "regex" else CONSTRAINTS[k][0] for k in kinds]
    params = [SamplingParams(max_tokens=48, temperature=0, guided_decoding=g) for g in guided]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    tight = LLM(tiny_code_engine, num_kv_blocks=8)
    outputs = tight.generate(prompts, params)
    assert tight.kv_cache_stats()["num_preemptions"] > 0
    expected = llm.generate(prompts, params)
    for kind, out, ref in zip(kinds, outputs, expected):
        assert out.token_ids == ref.token_ids
        if kind == "regex":
            assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text
        else:
            _check(kind, out)
    _assert_all_free(tight)
    assert len(tight.engine.guided_masker()) == 0  # every matcher released


def test_max_tokens_ends_a_constrained_request(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0,
                                                  guided_decoding=GuidedDecoding(regex="[a-z]{60}")))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert re.fullmatch("[a-z]+", out.text) and len(out.text) < 60
    _assert_all_free(llm)


@pytest.mark.parametrize("extra", [{"ignore_eos": True}, {"min_tokens": 12}])
def test_a_complete_constraint_ends_the_request_despite_ignore_eos_or_min_tokens(llm, extra):
    # Once "yes" / "no" / "maybe" is complete only EOS is allowed; the grammar accepting it ends the request.
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, **extra,
                                                  guided_decoding=GuidedDecoding(choice=list(CHOICES))))[0]
    assert out.finish_reason == "stop" and out.text in CHOICES and out.token_ids[-1] == EOS
    _assert_all_free(llm)


@pytest.mark.parametrize("guided, message", [
    (GuidedDecoding(json={"type": "object", "properties": {"a": {"$ref": "#/defs/missing"}}}),
     "guided_decoding.json: invalid JSON schema: "),
    (GuidedDecoding(regex="(ab"), "guided_decoding.regex: invalid regex: "),
    (GuidedDecoding(grammar="root ::= [a-"), "guided_decoding.grammar: invalid EBNF grammar: "),
])
def test_invalid_constraint_is_refused_before_anything_is_scheduled(llm, guided, message):
    good = SamplingParams(max_tokens=8, guided_decoding=GuidedDecoding(regex=REGEX))
    with pytest.raises(ValueError, match="prompt 1: " + re.escape(message)):
        llm.generate(PROMPTS[:2], [good, SamplingParams(max_tokens=8, guided_decoding=guided)])
    _assert_all_free(llm)
    assert len(llm.engine.guided_masker()) == 0  # the good request's matcher went with it
    assert not llm.engine.has_unfinished()


def test_without_xgrammar_a_constrained_request_says_how_to_install_it(tiny_code_engine, monkeypatch):
    engine = create_engine(tiny_code_engine, RuntimeOptions(num_kv_blocks=8))
    plain = engine.add_request("x = ", SamplingParams(max_tokens=2))  # unconstrained requests never need it
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    for name in ("kiln.runtime.sampling.guided_masker", "kiln.runtime.sampling.grammar_compiler"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ValueError, match=r"guided_decoding needs xgrammar: pip install xgrammar"):
        engine.add_request("x = ", SamplingParams(guided_decoding=GuidedDecoding(regex="a")))
    engine.abort(plain)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_async_llm_compiles_off_the_engine_thread_and_refuses_bad_constraints(tiny_code_engine, llm):
    from kiln.runtime import AsyncLLM

    async_llm = AsyncLLM(tiny_code_engine)
    params = [SamplingParams(max_tokens=40, temperature=0, guided_decoding=CONSTRAINTS[k][0]) for k in CONSTRAINTS]

    async def run(prompt, sampling):
        last = None
        async for out in async_llm.generate(prompt, sampling):
            last = out
        return last

    async def main():
        with pytest.raises(ValueError, match="guided_decoding.regex: invalid regex"):
            await run(PROMPTS[0], SamplingParams(guided_decoding=GuidedDecoding(regex="(ab")))
        return await asyncio.gather(*(run(PROMPTS[0], p) for p in params))

    try:
        results = asyncio.run(main())
    finally:
        async_llm.shutdown()
    expected = llm.generate([PROMPTS[0]] * len(params), params)
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    for kind, out in zip(CONSTRAINTS, results):
        _check(kind, out)
    _assert_all_free(async_llm)
