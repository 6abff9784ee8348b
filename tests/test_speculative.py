"""Speculative decoding end to end on the bundled pair (kiln-tiny-code and its draft), float32 on the CPU:
greedy output identical to decoding without speculation under tight limits, seeded sampling reproducible
alone and batched, counters consistent with token counts, every KV block back afterwards, refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from model_factory import make_checkpoint
from serve_util import EXAMPLES

from kiln.engine_format import EngineError
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.speculative import SpeculativeConfig

HELDOUT = (EXAMPLES / "heldout-sample.txt").read_text()
# Tight limits: chunked prefill (max_num_tokens), preemption (few KV blocks), a small batch.
TIGHT = dict(max_batch_size=6, max_num_tokens=40, num_kv_blocks=24)


def _configs(draft: Path) -> dict[str, SpeculativeConfig]:
    return {"ngram": SpeculativeConfig("ngram", 4, ngram_min=1, ngram_max=3),
            "draft_model": SpeculativeConfig("draft_model", 4, model=str(draft))}


@pytest.fixture(scope="module")
def prompts(tiny_code_engine):
    """24 prompts of 5..90 tokens from the held-out sample; some share long prefixes (prefix cache)."""
    tokenizer = LLM(tiny_code_engine, num_kv_blocks=8).tokenizer
    ids = tokenizer.encode(HELDOUT)
    out = []
    for i in range(24):
        start, length = (i * 97) % (len(ids) - 100), 5 + (i * 37) % 86
        if i % 6 == 5:  # the same start as the prompt before it: a shared prefix
            start = (i - 1) * 97 % (len(ids) - 100)
        out.append(ids[start:start + length])
    return out


def _params(i: int) -> SamplingParams:
    """Greedy, with every other SamplingParams feature mixed in."""
    base = SamplingParams(max_tokens=12 + (i * 7) % 29, temperature=0, ignore_eos=i % 3 != 0, logprobs=i % 4 == 0,
                          top_logprobs=2 if i % 8 == 0 else 0)
    extra = [{}, {"repetition_penalty": 1.3}, {"frequency_penalty": 0.5, "presence_penalty": 0.3},
             {"min_tokens": 6}, {"num_speculative_tokens": 0}, {"num_speculative_tokens": 2},
             {"stop": ("\n\n",)}, {"stop_token_ids": (13,)}][i % 8]
    return dataclasses.replace(base, **extra)


@pytest.fixture(scope="module")
def reference(tiny_code_engine, prompts):
    with LLM(tiny_code_engine, **TIGHT) as llm:
        return llm.generate(prompts, [_params(i) for i in range(len(prompts))])


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_output_is_identical_to_decoding_without_speculation(tiny_code_engine, tiny_code_draft_engine,
                                                                    prompts, reference, method):
    with LLM(tiny_code_engine, speculative_config=_configs(tiny_code_draft_engine)[method], **TIGHT) as llm:
        outputs = llm.generate(prompts, [_params(i) for i in range(len(prompts))])
        for i, (ref, out) in enumerate(zip(reference, outputs)):
            assert out.token_ids == ref.token_ids, f"prompt {i}"
            assert (out.text, out.finish_reason) == (ref.text, ref.finish_reason), f"prompt {i}"
            if ref.logprobs is not None:
                assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4), f"prompt {i}"
            if ref.top_logprobs is not None:
                assert [set(t) for t in out.top_logprobs] == [set(t) for t in ref.top_logprobs], f"prompt {i}"
        kv = llm.kv_cache_stats()
        stats = llm.speculation_stats()
        assert kv["free_blocks"] == kv["total_blocks"] and kv["num_preemptions"] > 0
        assert kv["prefix_cache_hit_tokens"] > 0
        assert stats["num_drafts"] > 0 and 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
        assert sum(stats["accepted_per_position"]) == stats["num_accepted_tokens"]
        per_position = stats["accepted_per_position"]
        assert all(a >= b for a, b in zip(per_position, per_position[1:]))  # draft i needs all before it
        if method == "draft_model":
            draft = llm.engine.speculator.proposer
            assert draft.blocks.num_free_blocks == draft.blocks.num_blocks  # its cache is back too


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_counters_add_up_to_the_tokens_generated(tiny_code_engine, tiny_code_draft_engine, prompts, method):
    # One request, EOS ignored: its first token comes from the prefill, every later step yields the accepted
    # drafts plus one token; only a step with no room for a draft (the last one) or no proposal has none.
    with LLM(tiny_code_engine, speculative_config=_configs(tiny_code_draft_engine)[method]) as llm:
        out = llm.generate(HELDOUT[:400], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]
        stats = llm.speculation_stats()
    assert len(out.token_ids) == 60
    steps_without_drafts = 60 - 1 - stats["num_drafts"] - stats["num_accepted_tokens"]
    assert steps_without_drafts >= 0
    if method == "draft_model":  # the draft proposes at every step but the last one
        assert steps_without_drafts <= 1
    assert stats["mean_accepted_length"] == pytest.approx(1 + stats["num_accepted_tokens"] / stats["num_drafts"])


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_sampling_is_reproducible_alone_and_batched(tiny_code_engine, tiny_code_draft_engine, prompts, method):
    seeded = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    others = SamplingParams(max_tokens=25, temperature=1.0, ignore_eos=True)
    with LLM(tiny_code_engine, speculative_config=_configs(tiny_code_draft_engine)[method]) as llm:
        alone = llm.generate(prompts[3], seeded)[0]
        again = llm.generate(prompts[3], seeded)[0]
        batched = llm.generate(prompts[:8], [seeded if i == 3 else others for i in range(8)])[3]
        assert llm.speculation_stats()["num_accepted_tokens"] > 0
    assert alone.token_ids == again.token_ids == batched.token_ids
    if method == "ngram":
        # A certain draft is verified by the very draw plain sampling makes at that position (the generator is
        # reseeded per position), so n-gram speculation leaves a seeded request's tokens exactly as they were.
        with LLM(tiny_code_engine, **TIGHT) as plain:
            assert plain.generate(prompts[3], seeded)[0].token_ids == alone.token_ids


def test_aborts_and_mid_flight_arrivals_keep_the_caches_exact(tiny_code_engine, tiny_code_draft_engine, prompts):
    config = _configs(tiny_code_draft_engine)["draft_model"]
    with LLM(tiny_code_engine, speculative_config=config, **TIGHT) as llm:
        engine = llm.engine
        greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        ids = [engine.add_request(p, greedy) for p in prompts[:4]]
        for _ in range(4):
            engine.step()
        late = [engine.add_request(p, greedy) for p in prompts[4:7]]  # join mid-flight
        engine.step()
        engine.abort(ids[1])
        engine.abort(late[0])
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert set(done) == {ids[0], ids[2], ids[3], late[1], late[2]}
        kv = llm.kv_cache_stats()
        assert kv["free_blocks"] == kv["total_blocks"]
        draft = engine.speculator.proposer
        assert draft.blocks.num_free_blocks == draft.blocks.num_blocks and not draft._sequences
    with LLM(tiny_code_engine, **TIGHT) as plain:
        expected = plain.generate([prompts[0], prompts[5]], greedy)
    assert [done[ids[0]].token_ids, done[late[1]].token_ids] == [o.token_ids for o in expected]


def test_a_draft_with_another_vocabulary_is_refused_naming_both_sizes(tiny_code_engine, tmp_path):
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    checkpoint, _ = make_checkpoint(tmp_path / "ckpt")
    draft = build_engine(checkpoint, tmp_path / "draft", BuildConfig(dtype="float32"), progress=False)
    target_vocab = LLM(tiny_code_engine, num_kv_blocks=8).engine.model_config.vocab_size
    with pytest.raises(EngineError) as e:
        LLM(tiny_code_engine, speculative_config={"model": str(draft), "num_speculative_tokens": 3})
    message = str(e.value)
    assert "vocabulary" in message and str(target_vocab) in message
    assert f"{LLM(draft, num_kv_blocks=8).engine.model_config.vocab_size} tokens" in message


@pytest.mark.parametrize(("options", "message"), [
    (dict(method="ngram", num_speculative_tokens=0), "--num-speculative-tokens 0 must be an integer in [1, 16]"),
    (dict(method="eagle", num_speculative_tokens=2),
     "--speculative-mode 'eagle' is not one of draft_model, ngram, eagle3"),
    (dict(method="draft_model", num_speculative_tokens=2), "needs --speculative-model DIR"),
    (dict(method="ngram", num_speculative_tokens=2, ngram_min=3, ngram_max=2), "--ngram-min 3 exceeds --ngram-max 2"),
])
def test_bad_speculative_options_name_the_flag(options, message):
    with pytest.raises(ValueError, match=None) as e:
        SpeculativeConfig(**options)
    assert message in str(e.value)


def test_vllm_style_dict_and_unknown_keys():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    assert (config.ngram_max, config.num_speculative_tokens) == (5, 3)
    with pytest.raises(ValueError, match="unknown keys \\['draft_tensor_parallel_size'\\]"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "model": "x", "draft_tensor_parallel_size": 1})
    with pytest.raises(ValueError, match="SamplingParams.num_speculative_tokens=-1"):
        SamplingParams(num_speculative_tokens=-1)


def test_generate_and_bench_report_acceptance(tiny_code_engine, tiny_code_draft_engine, capsys):
    from kiln.cli import main

    assert main(["generate", "--engine", str(tiny_code_engine), "--prompt", "def fibonacci(n):", "--max-tokens", "24",
                 "--temperature", "0", "--speculative-mode", "ngram", "--num-speculative-tokens", "3"]) == 0
    assert "speculative: mean accepted length" in capsys.readouterr().err
    assert main(["bench", "latency", "--engine", str(tiny_code_engine), "--input-len", "48", "--output-len", "16",
                 "--num-iters", "1", "--prompt-file", str(EXAMPLES / "heldout-sample.txt"),
                 "--speculative-model", str(tiny_code_draft_engine), "--num-speculative-tokens", "2"]) == 0
    table = capsys.readouterr().out
    assert "draft_model, K = 2" in table and "mean accepted length" in table and "per position:" in table


def test_server_exports_the_acceptance_counters(tiny_code_engine):
    import json
    import urllib.request

    from serve_util import MODEL_NAME, start_server

    server = start_server(tiny_code_engine, speculative_config=SpeculativeConfig("ngram", 3))
    try:
        body = json.dumps({"model": MODEL_NAME, "prompt": HELDOUT[:300], "max_tokens": 24, "temperature": 0}).encode()
        request = urllib.request.Request(f"{server.http_base}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
        with urllib.request.urlopen(server.metrics_url, timeout=30) as response:
            text = response.read().decode()
    finally:
        server.stop()
    drafts = [line for line in text.splitlines() if line.startswith("kiln_spec_decode_num_drafts_total ")]
    assert drafts and float(drafts[0].split()[1]) > 0
    assert 'kiln_spec_decode_num_accepted_tokens_per_pos_total{position="2"}' in text
