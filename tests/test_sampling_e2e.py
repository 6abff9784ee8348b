"""Sampling through the whole engine: seeds, top-k, logprobs, stop strings, stop ids, EOS, max_tokens."""

from __future__ import annotations

import json

import pytest
import torch
from model_factory import make_engine

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM, SamplingParams

PROMPT = "the cat sees"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    checkpoint, engine, hf_model = make_engine(tmp_path_factory.mktemp("sampling"), max_batch_size=8, max_num_tokens=64, max_seq_len=128)
    return checkpoint, engine, hf_model, LLM(engine)


def test_seeded_request_is_reproducible_alone_and_in_a_batch(setup):
    _, _, _, llm = setup
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0].token_ids
    assert llm.generate(PROMPT, seeded)[0].token_ids == alone
    others = [SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=1.2, seed=7, ignore_eos=True)]
    batch = llm.generate(["a small dog", PROMPT, "we like"], [others[0], seeded, others[1]])
    assert batch[1].token_ids == alone
    assert llm.generate(PROMPT, SamplingParams(max_tokens=16, seed=4321, ignore_eos=True))[0].token_ids != alone


def test_top_k_1_equals_greedy(setup):
    _, _, _, llm = setup
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    top1 = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_logprobs_equal_log_softmax_of_reference_logits(setup):
    _, _, hf_model, llm = setup
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.9, seed=3, logprobs=True,
                                              prompt_logprobs=True, ignore_eos=True))[0]
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)  # [L, V]
    n = len(out.prompt_token_ids)
    expected = [ref[n - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(expected, abs=1e-4)
    assert out.prompt_logprobs[0] is None
    expected_prompt = [ref[i - 1, out.prompt_token_ids[i]].item() for i in range(1, n)]
    assert out.prompt_logprobs[1:] == pytest.approx(expected_prompt, abs=1e-4)


def test_top_logprobs_are_the_most_likely_tokens_of_the_raw_distribution(setup):
    _, _, hf_model, llm = setup
    plain, top = llm.generate([PROMPT, PROMPT], [
        SamplingParams(max_tokens=6, temperature=0.9, seed=5, logprobs=True, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.9, seed=5, logprobs=True, top_logprobs=3, ignore_eos=True)])
    assert plain.top_logprobs is None and top.token_ids == plain.token_ids
    ids = torch.tensor([top.prompt_token_ids + top.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)  # [L, V]
    n = len(top.prompt_token_ids)
    for i, alternatives in enumerate(top.top_logprobs):
        values, indices = ref[n - 1 + i].topk(3)
        assert list(alternatives) == indices.tolist()
        assert list(alternatives.values()) == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_logprobs=2), "needs logprobs=True"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
])
def test_invalid_top_logprobs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_logprobs_survive_chunked_prefill(setup):
    _, engine, hf_model, _ = setup
    llm = LLM(engine, max_num_tokens=8)
    prompt = list(range(2, 40))
    out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert out.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-4)


def test_max_tokens_finishes_with_length(setup):
    _, _, _, llm = setup
    out = llm.generate(PROMPT, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_stop_string_cuts_text_before_it(setup):
    _, _, _, llm = setup
    full = llm.generate(PROMPT, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop = full.text[6:9]
    cut = full.text.index(stop)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_id_ends_request(setup):
    _, _, _, llm = setup
    full = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                              stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:first + 1]


def test_eos_ids_from_generation_config_list(setup, tmp_path):
    checkpoint, _, _, llm = setup
    full = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    eos = full.token_ids[3]
    gen_path = checkpoint / "generation_config.json"
    original = gen_path.read_text()
    gen = json.loads(original)
    gen["eos_token_id"] = [1, eos]
    gen_path.write_text(json.dumps(gen))
    try:
        engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(max_seq_len=128), progress=False)
    finally:
        gen_path.write_text(original)
    eos_llm = LLM(engine)
    out = eos_llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:full.token_ids.index(eos) + 1]
    ignored = eos_llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert ignored.token_ids == full.token_ids


def test_sampling_filters_run_in_the_engine(setup):
    _, _, _, llm = setup
    params = [SamplingParams(max_tokens=6, temperature=0.7, top_p=0.5, min_p=0.1, repetition_penalty=1.3,
                             presence_penalty=0.5, frequency_penalty=0.5, seed=i, ignore_eos=True) for i in range(4)]
    outs = llm.generate([PROMPT] * 4, params)
    assert all(len(o.token_ids) == 6 for o in outs)
    assert llm.kv_cache_stats()["free_blocks"] == llm.kv_cache_stats()["total_blocks"]
