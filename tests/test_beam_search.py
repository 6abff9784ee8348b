"""Beam search (issue 35, item 1) against Hugging Face transformers' generate(num_beams=B,
num_return_sequences=B, do_sample=False) on the bundled kiln-tiny-code in float32: the same beams token for
token, best first, with EOS, stop token ids, stop strings and max_tokens; under a tight KV cache (preemption)
and batched with plain requests, whose outputs stay what they are alone. The bookkeeping's own tests (copy-on-
write, block counts) are in test_beam_search_units.py."""

from __future__ import annotations

import pytest
import torch
from serve_util import EXAMPLES

from kiln.runtime import LLM, SamplingParams

CHECKPOINT = EXAMPLES / "kiln-tiny-code"
EOS_PROMPT = "if __name__ == '__main__':\n    main()\n"  # its best beam ends with EOS at once
PROMPTS = ["def fibonacci(n):", EOS_PROMPT, "class Stack:\n    def"]
# A dozen, for the main comparison with transformers.
MORE_PROMPTS = PROMPTS + ["import os\nimport sys\n", "for i in range(10):\n", "def add(a, b):\n    return",
                          "# read a file\nwith open(", "try:\n    import numpy", "x = [i * i for i in",
                          "@dataclass\nclass Point:\n", "def is_prime(n):\n    if n <", "import json\n\ndef load("]


@pytest.fixture(scope="module")
def beam_engine(tmp_path_factory):
    """kiln-tiny-code built in float32 with --max-beam-width 4."""
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    return build_engine(CHECKPOINT, tmp_path_factory.mktemp("beam") / "engine",
                        BuildConfig(dtype="float32", max_batch_size=16, max_num_tokens=256, max_beam_width=4),
                        progress=False)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINT)
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def llm(beam_engine):
    llm = LLM(beam_engine)
    yield llm
    llm.shutdown()


def hf_beams(hf, prompt_ids, width, max_tokens, length_penalty=1.0, early_stopping=False, stop=None,
             stop_token_ids=()):
    """HF's B beams, best first: (generated token ids, sequences_scores)."""
    model, tokenizer = hf
    ids = torch.tensor([prompt_ids])
    extra = dict(stop_strings=list(stop), tokenizer=tokenizer) if stop else {}
    if stop_token_ids:
        extra["eos_token_id"] = [model.generation_config.eos_token_id, *stop_token_ids]
    with torch.no_grad():
        out = model.generate(ids, num_beams=width, num_return_sequences=width, do_sample=False,
                             length_penalty=length_penalty, early_stopping=early_stopping, max_new_tokens=max_tokens,
                             output_scores=True, return_dict_in_generate=True, **extra)
    beams = []
    for i in range(width):
        n = int((out.beam_indices[i] >= 0).sum())
        beams.append((out.sequences[i, len(prompt_ids):len(prompt_ids) + n].tolist(), float(out.sequences_scores[i])))
    return beams


def check_same(output, reference, length_penalty=1.0):
    assert [c.token_ids for c in output.outputs] == [tokens for tokens, _ in reference]
    for c, (tokens, score) in zip(output.outputs, reference):
        assert c.score == pytest.approx(score, abs=1e-4)
        assert c.cumulative_logprob == pytest.approx(score * len(tokens) ** length_penalty, abs=1e-3)
    best = output.outputs[0]
    assert output.token_ids == best.token_ids and output.text == best.text
    assert output.finish_reason == best.finish_reason


@pytest.mark.parametrize("width,length_penalty,early_stopping", [(2, 1.0, False), (4, 0.5, True), (4, 2.0, "never")])
def test_beams_equal_transformers(llm, hf, width, length_penalty, early_stopping):
    tokenizer = hf[1]
    prompts = [tokenizer(p).input_ids for p in MORE_PROMPTS]
    params = SamplingParams(use_beam_search=True, n=width, length_penalty=length_penalty,
                            early_stopping=early_stopping, max_tokens=8, temperature=0)
    outputs = llm.generate(prompts, params)  # batched together: the beams of three requests in each step
    for prompt, output in zip(prompts, outputs):
        check_same(output, hf_beams(hf, prompt, width, 8, length_penalty, early_stopping), length_penalty)
    if length_penalty < 2:  # a long penalty favours the longer beams over the one that ended at once
        assert any(c.finish_reason == "stop" and c.token_ids[-1] == 1 for c in outputs[1].outputs)  # EOS
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in outputs[0].outputs)
    assert llm.kv_cache_stats()["free_blocks"] == llm.kv_cache_stats()["total_blocks"]


def test_stop_token_ids_and_strings(llm, hf):
    tokenizer = hf[1]
    prompt = tokenizer("def fibonacci(n):").input_ids
    plain = llm.generate([prompt], SamplingParams(use_beam_search=True, n=2, max_tokens=8, temperature=0))[0]
    stop_id = plain.outputs[0].token_ids[3]  # a token the best beam generates: some beam stops on it
    params = SamplingParams(use_beam_search=True, n=2, max_tokens=8, temperature=0, stop_token_ids=[stop_id])
    output = llm.generate([prompt], params)[0]
    check_same(output, hf_beams(hf, prompt, 2, 8, stop_token_ids=[stop_id]))
    assert any(c.finish_reason == "stop" and c.token_ids[-1] == stop_id for c in output.outputs)
    params = SamplingParams(use_beam_search=True, n=2, max_tokens=8, temperature=0, stop=["fib"])
    output = llm.generate([prompt], params)[0]
    check_same(output, hf_beams(hf, prompt, 2, 8, stop=["fib"]))
    assert any(c.finish_reason == "stop" for c in output.outputs)
    assert all("fib" not in c.text for c in output.outputs)


def test_preemption_and_plain_requests_in_the_batch(beam_engine, hf):
    """A cache too small for every beam of every request at once: beams are preempted (together) and
    recomputed, and the greedy and seeded sampled requests beside them keep the tokens they have alone."""
    tokenizer = hf[1]
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    plain = SamplingParams(max_tokens=8, temperature=0, logprobs=True)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, logprobs=True)
    beams = SamplingParams(use_beam_search=True, n=4, max_tokens=8, temperature=0)
    llm = LLM(beam_engine, num_kv_blocks=10)
    try:
        alone = llm.generate(prompts, plain)
        alone_sampled = llm.generate(prompts, sampled)
        mixed = llm.generate([p for p in prompts for _ in range(3)], [beams, plain, sampled] * len(prompts))
        assert llm.kv_cache_stats()["num_preemptions"] > 0
        assert llm.kv_cache_stats()["free_blocks"] == 10
    finally:
        llm.shutdown()
    for i, prompt in enumerate(prompts):
        check_same(mixed[3 * i], hf_beams(hf, prompt, 4, 8))
        for output, reference in ((mixed[3 * i + 1], alone[i]), (mixed[3 * i + 2], alone_sampled[i])):
            assert output.token_ids == reference.token_ids  # greedy and seeded sampling: unchanged by the beams
            assert output.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
            assert len(output.outputs) == 1 and output.outputs[0].token_ids == reference.token_ids


def test_limits_are_named(llm, beam_engine):
    with pytest.raises(ValueError, match=r"n=8 beams exceeds this engine's max_beam_width=4.*--max-beam-width 8"):
        llm.generate("x", SamplingParams(use_beam_search=True, n=8, temperature=0))
    with pytest.raises(ValueError, match="SamplingParams.n=2 .*use_beam_search=True"):
        SamplingParams(n=2)
    with pytest.raises(ValueError, match="SamplingParams.temperature=0.7 .*use_beam_search"):
        SamplingParams(use_beam_search=True, n=2, temperature=0.7)
    with pytest.raises(ValueError, match="SamplingParams.top_p=0.5 .*not supported with use_beam_search"):
        SamplingParams(use_beam_search=True, n=2, top_p=0.5)
    with pytest.raises(ValueError, match="SamplingParams.early_stopping='sometimes'"):
        SamplingParams(use_beam_search=True, n=2, early_stopping="sometimes")
    import json

    spec = json.loads((beam_engine / "engine.json").read_text())
    assert spec["build_config"]["max_beam_width"] == 4


def test_async_updates_carry_the_beams(llm, beam_engine):
    """AsyncLLM: every update holds the current beams whole (cumulative and delta alike), the last one the
    final beams LLM.generate returns."""
    import asyncio

    from kiln.runtime import AsyncLLM

    final = llm.generate("def fibonacci(n):", SamplingParams(use_beam_search=True, n=2, max_tokens=6,
                                                             temperature=0))[0]

    async def updates(engine, kind):
        params = SamplingParams(use_beam_search=True, n=2, max_tokens=6, temperature=0, output_kind=kind)
        return [out async for out in engine.generate("def fibonacci(n):", params)]

    engine = AsyncLLM(beam_engine)
    try:
        for kind in ("cumulative", "delta"):
            got = asyncio.run(updates(engine, kind))
            assert len(got) == 6 and all(len(out.outputs) == 2 for out in got)
            assert [len(out.outputs[0].token_ids) for out in got] == [1, 2, 3, 4, 5, 6]
            assert all(not out.finished for out in got[:-1]) and got[-1].finished
            assert got[-1].outputs == final.outputs and got[-1].text == final.text
        final_only = asyncio.run(updates(engine, "final_only"))
        assert len(final_only) == 1 and final_only[0].outputs == final.outputs
    finally:
        engine.shutdown()


def test_abort_mid_search_frees_every_beam(llm):
    engine = llm.engine
    request_id = engine.add_request("def fibonacci(n):", SamplingParams(use_beam_search=True, n=4, max_tokens=8,
                                                                      temperature=0))
    for _ in range(3):  # the prompt, then two beam steps: four beams with blocks of their own
        engine.step()
    assert engine.kv_cache_stats()["free_blocks"] < engine.kv_cache_stats()["total_blocks"]
    out = engine.abort(request_id)
    assert out.finish_reason == "abort" and len(out.outputs) == 4
    assert all(len(c.token_ids) == 2 for c in out.outputs)
    assert engine.kv_cache_stats()["free_blocks"] == engine.kv_cache_stats()["total_blocks"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_beams_on_cuda_run_in_graphs_and_equal_transformers(hf, tmp_path):
    """On CUDA the beams are decode rows of the captured graphs (async scheduling on), their forks copied in the
    cache before each replay: the same beams as transformers, and a plain request beside them unchanged."""
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    engine = build_engine(CHECKPOINT, tmp_path / "cuda", BuildConfig(device="cuda", dtype="float32", max_batch_size=16,
                                                                     max_num_tokens=256, max_beam_width=4),
                          progress=False)
    tokenizer = hf[1]
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    with LLM(engine) as llm:
        assert llm.engine.executor.runner.graphs is not None
        plain = SamplingParams(max_tokens=8, temperature=0)
        alone = llm.generate([prompts[0]], plain)[0].token_ids
        for width, length_penalty in ((2, 1.0), (4, 0.5)):
            params = SamplingParams(use_beam_search=True, n=width, length_penalty=length_penalty, max_tokens=8,
                                    temperature=0)
            outputs = llm.generate(prompts + [prompts[0]], [params] * len(prompts) + [plain])
            for prompt, output in zip(prompts, outputs):
                check_same(output, hf_beams(hf, prompt, width, 8, length_penalty), length_penalty)
            assert outputs[-1].token_ids == alone
        assert llm.kv_cache_stats()["free_blocks"] == llm.kv_cache_stats()["total_blocks"]
