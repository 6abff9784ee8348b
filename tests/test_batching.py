"""In-flight batching, chunking, preemption and prefix caching change no output."""

from __future__ import annotations

import random

import pytest
from model_factory import make_engine

from kiln.runtime import LLM, SamplingParams


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    _, engine, _ = make_engine(tmp_path_factory.mktemp("batching"), max_batch_size=16, max_num_tokens=256, max_seq_len=256, kv_block_size=4)
    return engine


def _requests(n: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 400) for _ in range(rng.randint(1, 60))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True) for _ in range(n)]
    return prompts, params


def test_tight_limits_give_the_tokens_each_request_gives_alone(engine_dir):
    prompts, params = _requests(24)
    alone_llm = LLM(engine_dir, enable_prefix_caching=False)
    alone = [alone_llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]

    # 4 requests and 32 tokens per step, 40 blocks of 4 tokens: prompts are chunked, requests queue,
    # and running requests run out of blocks and get preempted.
    llm = LLM(engine_dir, max_batch_size=4, max_num_tokens=32, num_kv_blocks=40)
    outputs = llm.generate(prompts, params)
    stats = llm.kv_cache_stats()
    assert stats["num_preemptions"] > 0
    for i, (out, expected) in enumerate(zip(outputs, alone)):
        assert out.token_ids == expected, f"request {i}"
        assert out.finish_reason == "length"
        assert len(out.token_ids) == params[i].max_tokens
    assert stats["free_blocks"] == stats["total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_greedy_is_independent_of_batch_composition(engine_dir):
    prompts, params = _requests(10, seed=1)
    llm = LLM(engine_dir)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    reversed_order = [o.token_ids for o in llm.generate(prompts[::-1], params[::-1])][::-1]
    assert together == reversed_order


def test_prefix_cache_reuses_blocks_and_changes_nothing(engine_dir):
    rng = random.Random(5)
    shared = [rng.randrange(2, 400) for _ in range(41)]
    first, second = shared + [11, 12, 13], shared + [21, 22]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    uncached = LLM(engine_dir, enable_prefix_caching=False)
    expected = [uncached.generate(p, sp)[0].token_ids for p in (first, second)]

    llm = LLM(engine_dir)
    out1 = llm.generate(first, sp)[0]
    before = llm.kv_cache_stats()
    out2 = llm.generate(second, sp)[0]
    after = llm.kv_cache_stats()
    assert [out1.token_ids, out2.token_ids] == expected
    assert out1.num_cached_tokens == 0
    assert out2.num_cached_tokens == 40  # the 10 full 4-token blocks of the shared 41 tokens
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 40
    assert before["cached_blocks"] > 0
    assert after["free_blocks"] == after["total_blocks"]  # cached blocks still count as free


def test_prompt_fully_cached_still_computes_its_last_token(engine_dir):
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompt = list(range(2, 2 + 16))  # exactly 4 blocks
    llm = LLM(engine_dir)
    a = llm.generate(prompt, sp)[0]
    b = llm.generate(prompt, sp)[0]
    assert a.token_ids == b.token_ids
    assert b.num_cached_tokens == 12  # the block holding the last prompt token is recomputed


def test_final_only_steps_hand_out_each_request_once_as_it_finished(tiny_code_engine):
    """engine.step(final_only=True) (what LLM.generate runs) returns a request only when it has finished, once,
    with the same tokens, text and finish reason as the last cumulative update of a plain step() loop; a stop
    string that ends a request mid-step included."""
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:", "x = 1"]
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(3)]
    params.append(SamplingParams(max_tokens=40, temperature=0.0, stop=["\n"]))  # ends on its first newline

    def run(final_only):
        with LLM(tiny_code_engine) as llm:
            ids = [llm.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            last, seen = {}, []
            while llm.engine.has_unfinished():
                for out in llm.engine.step(final_only=final_only):
                    seen.append(out.finished)
                    last[out.request_id] = out
            return [last[i] for i in ids], seen

    cumulative, seen_all = run(False)
    final, seen_final = run(True)
    assert not all(seen_all) and all(seen_final) and len(seen_final) == len(prompts)
    assert [(o.token_ids, o.text, o.finish_reason) for o in final] == \
        [(o.token_ids, o.text, o.finish_reason) for o in cumulative]
    assert final[3].finish_reason == "stop" and "\n" not in final[3].text


def test_final_only_steps_decode_the_text_once_when_the_request_ends(tiny_code_engine, monkeypatch):
    """Without stop strings nobody reads the text before the end: LLM.generate's tokens are deferred and decoded
    together with the last one (one add_token per request instead of one per token), same text."""
    from kiln.runtime.engine.detokenizer import IncrementalDetokenizer

    calls = []
    add_token = IncrementalDetokenizer.add_token
    monkeypatch.setattr(IncrementalDetokenizer, "add_token", lambda self, t: (calls.append(t), add_token(self, t))[1])
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with LLM(tiny_code_engine) as llm:
        out = llm.generate(["def fibonacci(n):", "import os\n"], sp)
    assert len(calls) == 2
    tokenizer = llm.engine.tokenizer
    assert [o.text for o in out] == [tokenizer.decode(o.token_ids, skip_special_tokens=True,
                                                      clean_up_tokenization_spaces=False) for o in out]
