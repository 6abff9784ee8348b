"""SamplingParams.output_kind (vLLM's RequestOutputKind): cumulative updates, delta updates that hold only what is
new, or one final update; the deltas of a request add up to its cumulative output."""

from __future__ import annotations

import dataclasses

import pytest

from kiln.runtime import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "x = 1"]
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2,
                   prompt_logprobs=True, prompt_top_logprobs=1),
    SamplingParams(max_tokens=40, temperature=0.0, stop=["\n"]),  # a stop string: held-back text, a cut
    SamplingParams(max_tokens=30, temperature=0.8, seed=7),  # may end on EOS
    SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, stop=["zzz"]),
]


def _updates(engine, kind):
    with LLM(engine) as llm:
        ids = [llm.engine.add_request(p, dataclasses.replace(sp, output_kind=kind)) for p, sp in zip(PROMPTS, PARAMS)]
        updates = {i: [] for i in ids}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                updates[out.request_id].append(out)
    return [updates[i] for i in ids]


def _joined(values):
    return None if values[0] is None else [v for part in values for v in part]


def test_deltas_add_up_to_the_cumulative_output(tiny_code_engine):
    cumulative = _updates(tiny_code_engine, "cumulative")
    delta = _updates(tiny_code_engine, "delta")
    for full, parts in zip(cumulative, delta):
        final = full[-1]
        assert len(parts) == len(full) and parts[-1].finish_reason == final.finish_reason
        assert [t for p in parts for t in p.token_ids] == final.token_ids
        assert "".join(p.text for p in parts) == final.text
        assert _joined([p.logprobs for p in parts]) == final.logprobs
        assert _joined([p.top_logprobs for p in parts]) == final.top_logprobs
        # prompt logprobs: in the first update only
        assert parts[0].prompt_logprobs == final.prompt_logprobs
        assert parts[0].prompt_top_logprobs == final.prompt_top_logprobs
        assert all(p.prompt_logprobs is None for p in parts[1:])
        # each delta's text is what the cumulative update at that point added
        shown = [u.text for u in full]
        assert ["".join(p.text for p in parts[:k + 1]) for k in range(len(parts))] == shown
    assert cumulative[1][-1].finish_reason == "stop" and "\n" not in cumulative[1][-1].text


def test_final_only_requests_get_one_update_in_a_plain_step_loop(tiny_code_engine):
    cumulative = _updates(tiny_code_engine, "cumulative")
    final = _updates(tiny_code_engine, "final_only")
    assert [len(u) for u in final] == [1] * len(PROMPTS)
    assert [(u[0].token_ids, u[0].text, u[0].logprobs) for u in final] == \
        [(u[-1].token_ids, u[-1].text, u[-1].logprobs) for u in cumulative]


def test_an_abort_hands_out_only_what_is_new(tiny_code_engine):
    sp = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, output_kind="delta")
    with LLM(tiny_code_engine) as llm:
        rid = llm.engine.add_request("def add(a, b):", sp)
        seen = []
        while len(seen) < 5:
            seen += [o for o in llm.engine.step() if o.request_id == rid]
        rest = llm.engine.abort(rid)
        reference = llm.generate("def add(a, b):", dataclasses.replace(sp, output_kind="cumulative"))[0]
    tokens = [t for o in seen + [rest] for t in o.token_ids]
    assert rest.finish_reason == "abort" and tokens == reference.token_ids[:len(tokens)]
    assert all(len(o.token_ids) == 1 for o in seen)


def test_llm_generate_returns_whole_outputs_whatever_the_kind(tiny_code_engine):
    with LLM(tiny_code_engine) as llm:
        outs = [llm.generate(PROMPTS[0], dataclasses.replace(PARAMS[3], output_kind=kind))[0]
                for kind in ("cumulative", "delta", "final_only")]
    assert len({(tuple(o.token_ids), o.text) for o in outs}) == 1 and len(outs[0].token_ids) == 9


def test_an_unknown_kind_is_named():
    with pytest.raises(ValueError, match=r"output_kind='streaming' is invalid: must be one of cumulative, "
                                         r"delta, final_only"):
        SamplingParams(output_kind="streaming")


def test_async_streams_of_deltas_add_up(tiny_code_engine):
    import asyncio

    from kiln.runtime import AsyncLLM

    llm = AsyncLLM(tiny_code_engine)

    async def stream(prompt, sp):
        return [out async for out in llm.generate(prompt, sp)]

    async def main():
        return await asyncio.gather(*(stream(p, dataclasses.replace(sp, output_kind="delta"))
                                      for p, sp in zip(PROMPTS, PARAMS)))

    try:
        streams = asyncio.run(main())
    finally:
        llm.shutdown()
    with LLM(tiny_code_engine) as sync:
        whole = sync.generate(PROMPTS, PARAMS)
    for parts, final in zip(streams, whole):
        assert [t for p in parts for t in p.token_ids] == final.token_ids
        assert "".join(p.text for p in parts) == final.text and parts[-1].finished
