"""Beam search's bookkeeping without a model: block tables shared by reference count, copy-on-write when two
beams would write one block, forks and ends counted block by block, preemption of a request's beams together
(plain Python: the scheduler, block manager and core/beam_search.py)."""

from __future__ import annotations

from types import SimpleNamespace

from kiln.runtime.core.beam_search import BeamState, beam_request_id
from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.request import Request, RequestStatus
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.core.scheduler import Scheduler, SchedulerLimits
from kiln.runtime.engine.beam_stage import BeamStage


def beam_request(request_id: str, prompt: list[int], width: int = 2, max_tokens: int = 4) -> Request:
    params = SamplingParams(use_beam_search=True, n=width, max_tokens=max_tokens, temperature=0)
    return Request(request_id, prompt, params, frozenset({1}), beams=BeamState.start(request_id, params, frozenset({1})))


def used(blocks: BlockManager) -> int:
    return blocks.num_blocks - blocks.num_free_blocks


def advance(stage: BeamStage, request: Request, num_new: int, continuations: list[list[tuple[int, float]]] | None):
    """What the engine's beam stage does after a step: `continuations` per beam row (token, logprob), best
    first; None for a prefill chunk."""
    tracked = SimpleNamespace(request=request, detokenizer=SimpleNamespace(tokenizer=None), perf=None)
    host = None
    if continuations is not None:
        scores = [[beam.score + lp for _, lp in row] for beam, row in zip(request.beams.search.running, continuations)]
        host = SimpleNamespace(scores=scores, token_ids=[[t for t, _ in row] for row in continuations],
                               logprobs=[[lp for _, lp in row] for row in continuations])
    rows = list(range(len(request.table_ids))) if continuations is not None else [-1] * len(request.table_ids)
    return stage._advance(tracked, num_new, rows, host)


def test_beams_share_blocks_copy_on_write_and_give_every_block_back():
    blocks = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(SchedulerLimits(max_batch_size=8, max_num_tokens=64), blocks)
    stage = BeamStage(blocks, max_seq_len=64)
    request = beam_request("r", [5, 6, 7, 8, 9, 10], width=2)
    scheduler.add_request(request)

    out = scheduler.schedule()  # the prompt, one row: beams do not exist before the first token
    assert [r.request_id for r in out.requests] == request.table_ids and len(out.requests) == 1
    assert beam_request_id(out.requests[0].request_id) == "r" and out.requests[0].num_sampled == 1
    assert used(blocks) == 2
    advance(stage, request, 6, [[(20, -0.1), (21, -0.2), (22, -3.0), (1, -4.0)]])
    assert [b.token_ids for b in request.beams.search.running] == [[20], [21]]
    assert used(blocks) == 2  # both beams hold the prompt's two blocks
    first, second = (blocks.block_table(t) for t in request.table_ids)
    assert tuple(first) == tuple(second)

    out = scheduler.schedule()  # both write position 6, in the shared second block: one of them copies it
    assert len(out.requests) == 2 and all(r.num_sampled == 1 for r in out.requests)
    assert len(out.block_copies) == 1 and used(blocks) == 3
    src, dst = out.block_copies[0]
    tables = [tuple(r.block_ids) for r in out.requests]
    assert tables[0][0] == tables[1][0] and {tables[0][1], tables[1][1]} == {src, dst}
    # Beam 0 continues twice (its table forks), beam 1 not at all (its blocks go back).
    advance(stage, request, 1, [[(30, -0.1), (31, -0.2), (32, -5.0), (33, -6.0)],
                                [(40, -5.0), (41, -6.0), (42, -7.0), (43, -8.0)]])
    assert [b.token_ids for b in request.beams.search.running] == [[20, 30], [20, 31]]
    assert used(blocks) == 2  # beam 1's copy of the second block is free again

    out = scheduler.schedule()
    assert len(out.block_copies) == 1 and used(blocks) == 3
    scheduler.finish_request("r", RequestStatus.FINISHED_STOPPED)
    assert used(blocks) == 0 and blocks.num_free_blocks == 16


def test_a_beam_that_hits_eos_finishes_and_the_search_ends():
    blocks = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(SchedulerLimits(max_batch_size=8, max_num_tokens=64), blocks)
    stage = BeamStage(blocks, max_seq_len=64)
    request = beam_request("r", [5, 6, 7], width=2, max_tokens=3)
    scheduler.add_request(request)
    scheduler.schedule()
    # EOS (1) is the best continuation: a finished hypothesis of length 1; two others run on.
    assert not advance(stage, request, 3, [[(1, -0.05), (20, -0.1), (21, -0.2), (22, -3.0)]])
    assert [h.token_ids for h in request.beams.search.finished] == [(1,)]
    scheduler.schedule()
    assert not advance(stage, request, 1, [[(30, -2.0), (31, -2.1), (1, -9.0), (2, -9.5)],
                                           [(40, -2.5), (41, -3.0), (1, -9.0), (2, -9.5)]])
    scheduler.schedule()
    assert advance(stage, request, 1, [[(50, -0.1), (51, -0.2), (1, -9.0), (2, -9.5)],
                                       [(60, -0.1), (61, -0.2), (1, -9.0), (2, -9.5)]])  # max_tokens: done
    results = request.beams.search.results()
    assert [h.finish_reason for h in results] == ["stop", "length"] and results[0].token_ids == (1,)


def test_preemption_takes_every_beam_and_frees_every_block():
    blocks = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(SchedulerLimits(max_batch_size=8, max_num_tokens=64), blocks)
    stage = BeamStage(blocks, max_seq_len=64)
    plain = Request("a", list(range(100, 144)), SamplingParams(max_tokens=8))  # 11 blocks
    request = beam_request("b", [5, 6, 7, 8, 9, 10, 11, 12], width=4, max_tokens=8)
    scheduler.add_request(plain)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert [r.request_id for r in out.requests][0] == "a" and used(blocks) == 13
    scheduler.update_after_step(out, {"a": [9]})
    advance(stage, request, 8, [[(20, -0.1), (21, -0.2), (22, -0.3), (23, -0.4), (24, -1), (25, -2), (26, -3),
                                 (27, -4)]])
    out = scheduler.schedule()  # "a" needs a block, the four beams one each: the newest request goes, all its beams
    assert out.preempted_ids == ("b",) and [r.request_id for r in out.requests] == ["a"]
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
    assert used(blocks) == 12  # "a" alone: every beam's block is back
    scheduler.finish_request("a", RequestStatus.FINISHED_LENGTH)
    out = scheduler.schedule()  # recomputed: every beam its whole sequence after the cached prompt block, in lockstep
    assert len(out.requests) == 4 and all(r.num_sampled == 1 and r.start_position == 4 for r in out.requests)
    assert [r.token_ids for r in out.requests] == [(9, 10, 11, 12, t) for t in (20, 21, 22, 23)]
    assert used(blocks) == 1 + 4 * 2  # the prompt's cached block, shared; two of its own for each beam
    scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert blocks.num_free_blocks == 16


def test_max_beam_width_is_a_build_limit_older_engines_read_as_1():
    import pytest

    from kiln.builder.build_config import BuildConfig
    from kiln.engine_format.config import EngineBuildConfig

    base = dict(dtype="float32", max_batch_size=8, max_num_tokens=64, max_seq_len=128, kv_block_size=16,
                kv_cache_dtype="float32")
    assert EngineBuildConfig.from_dict(base).max_beam_width == 1  # engine.json written before the flag
    assert EngineBuildConfig.from_dict({**base, "max_beam_width": 4}).to_dict()["max_beam_width"] == 4
    with pytest.raises(ValueError, match=r"max_beam_width=0 must be an integer in \[1, 1024\]"):
        EngineBuildConfig.from_dict({**base, "max_beam_width": 0})
    with pytest.raises(ValueError, match="max_beam_width=16 exceeds max_batch_size=8"):
        BuildConfig(max_batch_size=8, max_beam_width=16)


def test_beam_search_params_are_checked():
    import pytest

    params = SamplingParams(use_beam_search=True, n=3, length_penalty=0.0, early_stopping="never")
    assert params.beam_width == 3 and SamplingParams().beam_width == 0
    for bad, field in [(dict(n=0), "n"), (dict(n=2, use_beam_search=False), "n"), (dict(use_beam_search=1), "use_beam_search"),
                       (dict(length_penalty=float("nan")), "length_penalty"), (dict(early_stopping=1), "early_stopping"),
                       (dict(use_beam_search=True, seed=3), "seed"), (dict(use_beam_search=True, min_tokens=1), "min_tokens"),
                       (dict(use_beam_search=True, repetition_penalty=1.2), "repetition_penalty")]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
            SamplingParams(**bad)
