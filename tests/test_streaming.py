"""Streaming: the sync iterator, the asyncio interface, and abort."""

from __future__ import annotations

import asyncio

import pytest
from model_factory import make_engine
from serve_util import idle_kv_stats

from kiln.runtime import LLM, AsyncLLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = ["the cat", "a small dog sees", "we like the blue sky!", "Мария"]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    _, engine, _ = make_engine(tmp_path_factory.mktemp("stream"), max_batch_size=8, max_num_tokens=64, max_seq_len=128)
    return engine


@pytest.fixture(scope="module")
def expected(engine_dir):
    return LLM(engine_dir).generate(PROMPTS, GREEDY)


def test_stream_yields_growing_outputs_that_end_like_generate(engine_dir, expected):
    llm = LLM(engine_dir)
    seen: dict[str, list] = {}
    for out in llm.stream(PROMPTS, GREEDY):
        seen.setdefault(out.request_id, []).append(out)
    finals = [updates[-1] for updates in seen.values()]
    assert [f.token_ids for f in finals] == [e.token_ids for e in expected]
    assert [f.text for f in finals] == [e.text for e in expected]
    for updates in seen.values():
        assert [len(u.token_ids) for u in updates] == list(range(1, 13))
        assert all(not u.finished for u in updates[:-1]) and updates[-1].finish_reason == "length"
        texts = [u.text for u in updates]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # shown text is never taken back


def test_abort_while_streaming_frees_blocks(engine_dir):
    llm = LLM(engine_dir)
    outs = {}
    for out in llm.stream(PROMPTS, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)):
        outs[out.request_id] = out
        if len(out.token_ids) == 3 and out.request_id == "req-1":
            llm.abort("req-1")
    assert outs["req-1"].finish_reason == "abort"
    assert len(outs["req-1"].token_ids) == 3
    assert all(o.finish_reason == "length" for rid, o in outs.items() if rid != "req-1")
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]


def test_leaving_a_stream_early_aborts_the_rest(engine_dir):
    llm = LLM(engine_dir)
    for out in llm.stream(PROMPTS, GREEDY):
        if len(out.token_ids) == 2:
            break
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == 0
    assert llm.abort("no-such-request") is None


def test_async_many_concurrent_requests(engine_dir, expected):
    llm = AsyncLLM(engine_dir)

    async def run(prompt):
        last = None
        async for out in llm.generate(prompt, GREEDY):
            last = out
        return last

    async def main():
        return await asyncio.gather(*(run(p) for p in PROMPTS * 4))

    try:
        results = asyncio.run(main())
        assert [r.token_ids for r in results] == [e.token_ids for e in expected] * 4
        assert all(r.finished for r in results)
    finally:
        llm.shutdown()


def test_async_disconnect_and_bad_input(engine_dir, expected):
    llm = AsyncLLM(engine_dir)

    async def leave_early():
        async for out in llm.generate("the cat", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)):
            if len(out.token_ids) == 2:
                break  # like a client that went away

    async def finish(prompt):
        outs = [o async for o in llm.generate(prompt, GREEDY)]
        return outs[-1]

    async def bad():
        with pytest.raises(ValueError, match="prompt is empty"):
            async for _ in llm.generate("", GREEDY):
                pass

    async def main():
        results = await asyncio.gather(leave_early(), finish(PROMPTS[1]), bad(), leave_early())
        stats = await idle_kv_stats(llm)
        return results, stats

    try:
        results, stats = asyncio.run(main())
        assert results[1].token_ids == expected[1].token_ids
        assert stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == 0
    finally:
        llm.shutdown()


def test_async_explicit_abort(engine_dir):
    llm = AsyncLLM(engine_dir)

    async def main():
        gen = llm.generate("the cat", SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
                           request_id="mine")
        first = await gen.__anext__()
        await llm.abort("mine")
        rest = [o async for o in gen]
        return first, rest

    try:
        first, rest = asyncio.run(main())
        assert not first.finished
        assert rest and rest[-1].finish_reason == "abort"
        assert llm.kv_cache_stats()["free_blocks"] == llm.kv_cache_stats()["total_blocks"]
    finally:
        llm.shutdown()
