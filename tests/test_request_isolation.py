"""One request's failure ends that request alone (finish_reason "error", RequestFailed through AsyncLLM) and the
engine goes on; an engine that stops fails every request at once; several tokens accepted in one step (speculative
decoding) reach a delta stream whole, with only the last update marked finished. The bundled kiln-tiny-code,
float32 on the CPU."""

from __future__ import annotations

import asyncio
import time

import pytest

from kiln.engine_format import EngineError
from kiln.runtime import LLM, AsyncLLM, GuidedDecoding, SamplingParams
from kiln.runtime.core.request_failure import EngineDeadError, RequestFailed
from kiln.runtime.speculative import SpeculativeConfig

# Compiles and allows "def" at first, then nothing at all: the failure comes mid-generation, on the engine thread.
DEAD_END = GuidedDecoding(grammar='root ::= "def" x\nx ::= x')
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "def add(a, b):"]


def _greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


@pytest.fixture(scope="module")
def llm(tiny_code_engine):
    with LLM(tiny_code_engine) as llm:
        yield llm


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt's greedy tokens with nothing else in the batch."""
    return {p: llm.generate(p, _greedy())[0].token_ids for p in PROMPTS}


def test_a_constraint_that_leads_nowhere_ends_its_request_alone(llm, alone):
    params = [_greedy(), _greedy(guided_decoding=DEAD_END), _greedy(), _greedy()]
    outs = llm.generate(PROMPTS, params)
    failed = outs[1]
    assert failed.finish_reason == "error"
    assert failed.error is not None and failed.error.client_error
    assert "allows no token" in failed.error.message
    for i in (0, 2, 3):
        assert outs[i].finish_reason == "length" and outs[i].error is None
        assert outs[i].token_ids == alone[PROMPTS[i]]
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == 0
    assert llm.generate(PROMPTS[1], _greedy())[0].token_ids == alone[PROMPTS[1]]  # still serving


def test_a_failing_detokenizer_ends_its_request_alone(llm, alone, monkeypatch):
    """A per-request host failure that is kiln's fault (not the client's): that request ends with an internal
    error, the batch goes on."""
    engine = llm.engine
    ids = [engine.add_request(p, _greedy(max_tokens=6)) for p in PROMPTS[:2]]
    broken = engine._tracked[ids[0]].detokenizer

    def boom(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "test")

    monkeypatch.setattr(broken, "add_token", boom)
    final = {}
    while len(final) < 2:
        for out in engine.step(final_only=True):
            final[out.request_id] = out
    assert final[ids[0]].finish_reason == "error" and not final[ids[0]].error.client_error
    assert "internal error" in final[ids[0]].error.message
    assert final[ids[1]].finish_reason == "length"
    assert final[ids[1]].token_ids == alone[PROMPTS[1]][:6]
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]


def test_async_llm_raises_request_failed_and_keeps_serving(tiny_code_engine, alone):
    llm = AsyncLLM(tiny_code_engine)

    async def collect(prompt, params):
        return [out async for out in llm.generate(prompt, params)]

    async def main():
        healthy = asyncio.ensure_future(collect(PROMPTS[0], _greedy(output_kind="delta")))
        with pytest.raises(RequestFailed) as failed:
            await collect(PROMPTS[1], _greedy(guided_decoding=DEAD_END))
        assert failed.value.failure.client_error
        outs = await healthy
        assert [t for o in outs for t in o.token_ids] == alone[PROMPTS[0]]
        assert llm.is_running
        again = await collect(PROMPTS[2], _greedy())
        assert again[-1].token_ids == alone[PROMPTS[2]]

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_deltas_add_up_to_the_whole_output(tiny_code_engine, tiny_code_draft_engine, method):
    """Several tokens accepted in a request's last step all reach a delta stream (they used to be dropped
    after the first update marked finished), and only the last update is marked finished."""
    config = (SpeculativeConfig("ngram", 3, ngram_min=1, ngram_max=3) if method == "ngram" else
              {"model": str(tiny_code_draft_engine), "num_speculative_tokens": 4})
    params = [_greedy(64), _greedy(64, stop=("return",)), _greedy(40), _greedy(64)]
    with LLM(tiny_code_engine) as plain:
        expected = plain.generate(PROMPTS, params)
    llm = AsyncLLM(tiny_code_engine, speculative_config=config)

    async def stream(prompt, p):
        return [out async for out in llm.generate(prompt, p)]

    async def main():
        return await asyncio.gather(*(stream(prompt, SamplingParams(**{**_fields(p), "output_kind": kind}))
                                      for prompt, p in zip(PROMPTS, params) for kind in ("delta", "cumulative")))

    try:
        results = asyncio.run(main())
    finally:
        llm.shutdown()
    assert llm.engine.speculation_stats()["num_accepted_tokens"] > 0
    for i, want in enumerate(expected):
        delta, cumulative = results[2 * i], results[2 * i + 1]
        for updates in (delta, cumulative):
            assert [u.finished for u in updates] == [False] * (len(updates) - 1) + [True]
        assert [t for u in delta for t in u.token_ids] == want.token_ids
        assert "".join(u.text for u in delta) == want.text
        assert cumulative[-1].token_ids == want.token_ids and cumulative[-1].text == want.text
        assert delta[-1].finish_reason == cumulative[-1].finish_reason == want.finish_reason


def _fields(p: SamplingParams) -> dict:
    import dataclasses

    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}


def test_an_engine_that_fails_fails_every_request_at_once(tiny_code_engine, monkeypatch):
    """A dead engine (here: the executor fails, as when a tensor-parallel rank dies) ends every running stream
    with EngineDeadError within moments, refuses new requests the same way, and leaves no caller waiting."""
    llm = AsyncLLM(tiny_code_engine)
    executor = llm.engine.executor
    real_execute = executor.execute
    steps = {"n": 0}

    def execute(step):
        steps["n"] += 1
        if steps["n"] > 6:
            executor.fault = "rank 1 exited (test)"
            raise EngineError(executor.fault)
        return real_execute(step)

    monkeypatch.setattr(executor, "execute", execute)
    monkeypatch.setattr(executor, "fault", None, raising=False)

    async def stream(prompt):
        return [out async for out in llm.generate(prompt, _greedy(200))]

    async def main():
        started = time.monotonic()
        results = await asyncio.gather(*(stream(p) for p in PROMPTS * 3), return_exceptions=True)
        assert time.monotonic() - started < 10
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "rank 1 exited" in str(results[0])
        with pytest.raises(EngineDeadError):
            await stream(PROMPTS[0])
        with pytest.raises(EngineDeadError):
            await llm.abort("nobody")

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert not llm.is_running
