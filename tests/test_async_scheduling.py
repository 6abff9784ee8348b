"""Async scheduling: step N+1 is scheduled and launched before step N's tokens are read back, its input
tokens fed from N's samples on the device. It must change no output, lose no KV block, and fall back to
reading back first where sampling needs the tokens' values (penalties, guided decoding)."""

from __future__ import annotations

import random

import pytest
from model_factory import make_engine
from serve_util import idle_kv_stats

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.request import PLACEHOLDER, Request
from kiln.runtime.core.scheduler import Scheduler, SchedulerLimits


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    _, engine, _ = make_engine(tmp_path_factory.mktemp("async"), max_batch_size=16, max_num_tokens=256,
                               max_seq_len=256, kv_block_size=4)
    return engine


def _run(engine_dir, prompts, params, async_scheduling: bool, **limits):
    """Outputs, the number of steps that were fed tokens on the device, and the KV stats after."""
    llm = LLM(engine_dir, async_scheduling=async_scheduling, **limits)
    fed = []
    execute = llm.engine.executor.execute

    def spy(step):
        fed.append(step.token_feed is not None)
        return execute(step)

    llm.engine.executor.execute = spy
    outputs = llm.generate(prompts, params)
    return outputs, sum(fed), llm.kv_cache_stats()


def _same(a, b):
    assert [(o.token_ids, o.text, o.finish_reason) for o in a] == [(o.token_ids, o.text, o.finish_reason) for o in b]
    for x, y in zip(a, b):  # logprobs: other batch compositions round differently
        assert (x.logprobs is None) == (y.logprobs is None)
        if x.logprobs is not None:
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
            assert [sorted(t) for t in x.top_logprobs or []] == [sorted(t) for t in y.top_logprobs or []]


def test_async_scheduling_changes_no_output_under_preemption_chunking_and_sampling(engine_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 400) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True) for _ in range(24)]
    params[3] = SamplingParams(max_tokens=20, temperature=0.8, seed=7, logprobs=True, top_logprobs=2)
    params[4] = SamplingParams(max_tokens=20, temperature=0, min_tokens=5, stop_token_ids=[7, 9, 11, 13, 15])
    params[5] = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=20, seed=3)
    prompts[7] = prompts[8] = prompts[9]  # prefix-cache hits on blocks hashed after their tokens resolved
    # 4 requests and 32 tokens per step, 40 blocks of 4 tokens: chunked prompts, a queue, preemptions.
    limits = dict(max_batch_size=4, max_num_tokens=32, num_kv_blocks=40)
    sync, fed_sync, _ = _run(engine_dir, prompts, params, False, **limits)
    overlapped, fed, stats = _run(engine_dir, prompts, params, True, **limits)
    assert fed_sync == 0 and fed > 20
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    _same(sync, overlapped)
    assert stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == stats["num_waiting"] == 0


def test_async_scheduling_on_the_bundled_model_eos_stop_strings_and_stop_tokens(tiny_code_engine):
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:", "x = 1", "def add(a, b):", "# sort a list"]
    params = [SamplingParams(max_tokens=60, temperature=0.0),  # runs to EOS
              SamplingParams(max_tokens=40, temperature=0.0, stop=["\n"]),  # a stop string, found a step late
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[13]),
              SamplingParams(max_tokens=50, temperature=0.7, seed=11, logprobs=True),
              SamplingParams(max_tokens=25, temperature=0.0, frequency_penalty=0.5)]  # reads back first
    sync, _, _ = _run(tiny_code_engine, prompts, params, False)
    overlapped, fed, stats = _run(tiny_code_engine, prompts, params, True)
    _same(sync, overlapped)
    assert fed > 0 and {o.finish_reason for o in overlapped} == {"stop", "length"}
    assert stats["free_blocks"] == stats["total_blocks"]


def test_penalties_read_each_step_back_first(tiny_code_engine):
    """A step with a penalized request is not overlapped: the penalty counts the tokens sampled so far."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.2)
    sync, _, _ = _run(tiny_code_engine, ["def f(x):"] * 2, params, False)
    overlapped, fed, _ = _run(tiny_code_engine, ["def f(x):"] * 2, params, True)
    _same(sync, overlapped)
    assert fed == 0


def test_abort_under_async_scheduling_keeps_the_others_and_frees_every_block(tiny_code_engine):
    llm = LLM(tiny_code_engine, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in ("def f(x):", "import sys", "class A:")]
    for _ in range(5):
        engine.step()
    engine.abort(ids[1])
    last = {}
    while engine.has_unfinished():
        for out in engine.step():
            last[out.request_id] = out
    alone = LLM(tiny_code_engine, async_scheduling=False).generate(["def f(x):", "class A:"], params)
    assert [last[ids[0]].token_ids, last[ids[2]].token_ids] == [o.token_ids for o in alone]
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]


def test_cpu_default_is_off_and_the_flag_turns_it_off(tiny_code_engine):
    assert not LLM(tiny_code_engine).engine.async_scheduling  # the CPU computes inside the launch
    assert not LLM(tiny_code_engine, async_scheduling=False).engine.async_scheduling
    assert LLM(tiny_code_engine, async_scheduling=True).engine.async_scheduling


# ---- the scheduler's half ----------------------------------------------------------------------

def test_advance_gives_placeholders_resolve_replaces_them_and_hashes_only_then():
    bm = BlockManager(16, 4)
    sched = Scheduler(SchedulerLimits(8, 64), bm)
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=10))
    sched.add_request(request)
    first = sched.schedule()
    assert sched.advance_inflight(first, max_seq_len=64) == set()
    assert request.output_token_ids == [PLACEHOLDER] and request.num_computed_tokens == 3
    second = sched.schedule()  # scheduled before the first step's token is known
    assert second.requests[0].token_ids == (PLACEHOLDER,) and second.requests[0].start_position == 3
    assert bm.num_cached_blocks == 0
    sched.resolve_inflight(first, {"a": [4]})
    assert request.output_token_ids == [4]
    sched.advance_inflight(second, max_seq_len=64)
    assert bm.num_cached_blocks == 0  # block [1, 2, 3, 4] is full, but its last token is a placeholder
    sched.resolve_inflight(second, {"a": [5]})
    assert request.output_token_ids == [4, 5] and bm.find_cached_prefix([1, 2, 3, 4, 9]).num_tokens == 4


def test_requests_that_end_by_length_are_not_scheduled_again():
    sched = Scheduler(SchedulerLimits(8, 64), BlockManager(16, 4))
    short = Request("short", [1, 2], SamplingParams(max_tokens=1))
    tight = Request("tight", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=5))  # max_seq_len 8
    other = Request("other", [1, 2], SamplingParams(max_tokens=5))
    for r in (short, tight, other):
        sched.add_request(r)
    first = sched.schedule()
    finishing = sched.advance_inflight(first, max_seq_len=8)
    assert finishing == {"short", "tight"}
    assert [r.request_id for r in sched.schedule(finishing).requests] == ["other"]


def test_async_llm_streams_with_async_scheduling(tiny_code_engine):
    """The serving path (AsyncLLM, streamed updates, a client that leaves early) with async scheduling: each
    update holds the tokens of the same update without it, and an abandoned request's blocks come back."""
    import asyncio

    from kiln.runtime import AsyncLLM

    prompts = ["def fibonacci(n):", "import os\n", "class Stack:", "x = 1"]
    params = SamplingParams(max_tokens=20, temperature=0.0)
    expected = LLM(tiny_code_engine, async_scheduling=False).generate(prompts, params)
    llm = AsyncLLM(tiny_code_engine, async_scheduling=True)

    async def run(prompt):
        updates = [out.token_ids async for out in llm.generate(prompt, params)]
        assert all(a == b[:len(a)] for a, b in zip(updates, updates[1:]))  # each extends the one before
        return updates[-1]

    async def leave_early():
        async for out in llm.generate("def main():", SamplingParams(max_tokens=40, ignore_eos=True)):
            if len(out.token_ids) == 3:
                break

    async def main():
        results = await asyncio.gather(*(run(p) for p in prompts), leave_early())
        stats = await idle_kv_stats(llm)
        return results[:-1], stats

    try:
        assert llm.engine.async_scheduling
        results, stats = asyncio.run(main())
        assert results == [o.token_ids for o in expected]
        assert stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == 0
    finally:
        llm.shutdown()
