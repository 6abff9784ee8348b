"""Block tables handed out by reference (BlockTable) and kept by the runner between steps (BlockTableMirror):
whatever the scheduler does to a table between steps (growth, chunked prefill, prefix-cache sharing, draft
slots trimmed, preemption, requests ending so that the others move up in the batch), the incrementally updated
step inputs equal a pack from scratch. The CUDA-graph staging is checked through its host side on the CPU."""

from __future__ import annotations

import dataclasses
import pickle
import random

import numpy as np
import pytest
import torch

from kiln.model_defs import ModelConfig
from kiln.model_defs.config import RopeConfig
from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.block_table import BlockTable
from kiln.runtime.core.request import Request, RequestStatus
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.core.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from kiln.runtime.worker import cuda_graphs, prefill_graphs
from kiln.runtime.worker.block_table_mirror import RECENT_GATHERS, BlockTableMirror
from kiln.runtime.worker.kv_cache import KVCache
from kiln.runtime.worker.step_inputs import pack_step

BS = 4
VOCAB = 50


def padded(tables) -> np.ndarray:
    """The block tables as a from-scratch pack makes them: [S, longest] int32, zero-padded."""
    width = max(len(t) for t in tables)
    rows = [list(t) + [0] * (width - len(t)) for t in tables]
    return np.array(rows, dtype=np.int32).reshape(len(tables), width)


# ---- BlockTable: a shared snapshot ----------------------------------------------------------------
def test_a_snapshot_keeps_its_blocks_while_the_table_grows_and_names_what_was_added():
    bm = BlockManager(16, BS)
    assert bm.allocate("a", 5)
    first = bm.block_table("a")
    assert bm.allocate("a", 13)
    later = bm.block_table("a")
    assert len(first) == 2 and len(later) == 4
    assert later.stamp == first.stamp and later[:2] == tuple(first)
    assert later.since(2) == list(later[2:]) and first.since(2) == []


def test_trim_and_free_start_a_new_list_and_leave_old_snapshots_as_they_were():
    bm = BlockManager(16, BS)
    assert bm.allocate("a", 16)
    before = bm.block_table("a")
    blocks = tuple(before)
    bm.trim("a", 5)
    trimmed = bm.block_table("a")
    assert trimmed.stamp != before.stamp and tuple(trimmed) == blocks[:2]
    assert bm.allocate("a", 16) and bm.allocate("b", 16)  # the trimmed blocks are handed out again
    assert tuple(before) == blocks and len(before) == 4
    bm.free("a")
    assert tuple(before) == blocks and bm.block_table("a") == () and bm.block_table("a").stamp == 0
    assert bm.allocate("a", 4) and bm.block_table("a").stamp not in (before.stamp, trimmed.stamp)


def test_a_block_table_compares_hashes_slices_and_pickles_like_a_tuple():
    ids = [7, 3, 9]
    table = BlockTable(ids, 2, stamp=5)
    ids.append(1)  # past its length: not part of it
    assert table == (7, 3) and (7, 3) == table and table != (7, 3, 9) and table != [7, 3]
    assert hash(table) == hash((7, 3)) and table == BlockTable([7, 3, 8], 2, stamp=6)
    assert table[-1] == 3 and table[:1] == (7,) and list(table) == [7, 3] and 3 in table and 9 not in table
    with pytest.raises(IndexError):
        table[2]
    copy = pickle.loads(pickle.dumps(table))
    assert copy == table and copy.stamp == 5 and len(copy) == 2


# ---- the mirror against packs from scratch --------------------------------------------------------
class Driver:
    """A scheduler under pressure: shared prompt prefixes (prefix caching), chunked prefill, little memory
    (preemption), draft tokens with some rejected (trim), aborts, and requests coming and going."""

    def __init__(self, seed: int, num_blocks: int = 40, max_batch_size: int = 6, max_num_tokens: int = 24,
                 arrivals: float = 0.3, drafts: float = 0.5) -> None:
        self.rng = random.Random(seed)
        self.arrivals, self.drafts = arrivals, drafts
        self.bm = BlockManager(num_blocks, BS)
        self.sched = Scheduler(SchedulerLimits(max_batch_size, max_num_tokens), self.bm)
        self.system = [self.rng.randrange(VOCAB) for _ in range(9)]
        self.count = 0
        self.preemptions = self.trims = 0  # trims: blocks of rejected drafts given back
        trim = self.bm.trim

        def counting_trim(request_id: str, num_tokens: int) -> None:
            before = len(self.bm.block_table(request_id))
            trim(request_id, num_tokens)
            self.trims += len(self.bm.block_table(request_id)) < before

        self.bm.trim = counting_trim

    def add(self) -> None:
        prompt = self.system[:self.rng.choice((0, 4, 9))] + [self.rng.randrange(VOCAB)
                                                             for _ in range(self.rng.randrange(1, 30))]
        params = SamplingParams(max_tokens=self.rng.randrange(1, 40))
        self.sched.add_request(Request(f"r{self.count}", prompt, params))
        self.count += 1

    def steps(self, n: int):
        for _ in range(n):
            if self.rng.random() < self.arrivals or not self.sched.has_unfinished():
                self.add()
            for request in self.sched.running:  # drafts for the decoding requests
                if request.num_computed_tokens == request.num_tokens - 1 and self.rng.random() < self.drafts:
                    k = self.rng.randrange(1, 6)
                    request.draft_token_ids = [self.rng.randrange(VOCAB) for _ in range(k)]
            out = self.sched.schedule()
            self.preemptions += len(out.preempted_ids)
            yield out
            accepted = {}
            for item in out.requests:
                if item.num_sampled:
                    kept = self.rng.randrange(item.num_sampled)  # drafts that match, then the model's own token
                    accepted[item.request_id] = [*item.draft_token_ids[:kept], self.rng.randrange(VOCAB)]
            self.sched.update_after_step(out, accepted)
            for item in out.requests:
                request = self.sched.get(item.request_id)
                if request is None:
                    continue
                if len(request.output_token_ids) >= request.sampling_params.max_tokens or self.rng.random() < 0.02:
                    self.sched.finish_request(item.request_id, RequestStatus.FINISHED_LENGTH)


@pytest.mark.parametrize("seed", range(4))
def test_mirrored_tables_equal_a_pack_from_scratch_under_every_scheduler_event(seed):
    driver = Driver(seed)
    mirror = BlockTableMirror()
    small = BlockTableMirror(1, 1)  # grows, and reuses rows as tables come and go
    rank = BlockTableMirror()  # a tensor-parallel rank's: its tables arrive pickled, a new list each step
    staging = np.full((8, 64), -1, dtype=np.int32)  # like the CUDA graphs' pinned buffer: wider than needed
    for out in driver.steps(300):
        if out.is_empty:
            continue
        tables = [r.block_ids for r in out.requests]
        assert all(isinstance(t, BlockTable) and t.stamp for t in tables)
        expected = padded(tables)
        assert np.array_equal(mirror.gather(tables), expected)
        assert np.array_equal(small.gather(tables), expected)
        assert np.array_equal(rank.gather(pickle.loads(pickle.dumps(tables))), expected)
        view = mirror.gather(tables, out=staging[:len(tables)])
        assert view.base is staging and np.array_equal(staging[:len(tables), :expected.shape[1]], expected)
        mixed = [tuple(t) if i % 2 else t for i, t in enumerate(tables)]  # plain tuples are written whole
        assert np.array_equal(mirror.gather(mixed), expected)
    assert driver.preemptions and driver.trims and driver.bm.prefix_hit_tokens, (  # every event happened
        driver.preemptions, driver.trims, driver.bm.prefix_hit_tokens)


def test_a_decoding_batch_writes_only_the_blocks_its_tables_gained(monkeypatch):
    bm = BlockManager(64, BS)
    sched = Scheduler(SchedulerLimits(8, 64), bm)
    for i in range(4):
        sched.add_request(Request(f"r{i}", list(range(10 + 3 * i)), SamplingParams(max_tokens=30)))
    mirror = BlockTableMirror()
    writes: list[int] = []
    real_write = BlockTableMirror._write
    def write(self, row, start, blocks):
        writes.append(len(blocks))
        real_write(self, row, start, blocks)

    monkeypatch.setattr(BlockTableMirror, "_write", write)
    seen: dict[str, int] = {}
    for step in range(20):
        out = sched.schedule()
        writes.clear()
        mirror.gather([r.block_ids for r in out.requests])
        gained = [len(r.block_ids) - seen.get(r.request_id, 0) for r in out.requests]
        assert writes == [g for g in gained if g]  # the whole table once, then nothing unless it grew
        assert step == 0 or sum(gained) <= len(gained)  # a block at most per decode step
        seen = {r.request_id: len(r.block_ids) for r in out.requests}
        if step == 5:  # a request ends: the others move up in the batch but keep their rows
            sched.finish_request("r0", RequestStatus.FINISHED_STOPPED)
        sched.update_after_step(out, {r.request_id: [1] for r in out.requests})


def test_rows_of_recent_gathers_are_kept_and_old_ones_reused():
    mirror = BlockTableMirror(2, 4)
    a, b = BlockTable([1, 2], stamp=101), BlockTable([3], stamp=102)
    mirror.gather([a, b])
    mirror.gather([BlockTable([4], stamp=103)])  # a and b are recent: a row more, not theirs
    assert mirror.num_rows > 2
    for _ in range(RECENT_GATHERS):
        mirror.gather([BlockTable([5, 6, 7], stamp=104)])
    rows = mirror.num_rows
    for stamp in range(105, 105 + rows):  # new tables take the old rows, whose blocks they overwrite
        assert np.array_equal(mirror.gather([BlockTable([9], stamp=stamp)]), [[9]])
    assert mirror.num_rows == rows
    with pytest.raises(ValueError, match="width of 2"):
        mirror.gather([BlockTable([1, 2, 3], stamp=999)], width=2)


def test_pack_step_with_a_kept_mirror_equals_a_pack_from_scratch():
    config = ModelConfig("LlamaForCausalLM", 32, 8, 16, 1, 2, 1, 4, 1e-6, 64, RopeConfig())
    cache = KVCache(config, 8, BS, torch.float32, torch.device("cpu"))
    driver = Driver(7)
    mirror = BlockTableMirror()
    for out in driver.steps(150):
        if out.is_empty:
            continue
        packed = pack_step(out, BS, cache.layers, torch.device("cpu"), mirror=mirror)
        copies = tuple(dataclasses.replace(r, block_ids=tuple(r.block_ids)) for r in out.requests)
        scratch = SchedulerOutput(copies, out.preempted_ids)
        reference = pack_step(scratch, BS, cache.layers, torch.device("cpu"), mirror=BlockTableMirror())
        ctx, ref = packed.context, reference.context
        for name in ("positions", "rope_lengths", "slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
            assert torch.equal(getattr(ctx, name), getattr(ref, name)), name
        assert torch.equal(packed.input_ids, reference.input_ids)
        assert torch.equal(packed.sample_rows, reference.sample_rows)
        assert packed.logits_offsets == reference.logits_offsets
        # The slot and rope-length runs against the per-position definitions.
        at = [(r, r.start_position + i) for r in out.requests for i in range(len(r.token_ids))]
        assert ctx.positions.tolist() == [p for _, p in at]
        assert ctx.slot_mapping.tolist() == [r.block_ids[p // BS] * BS + p % BS for r, p in at]
        assert ctx.rope_lengths.tolist() == [max(p + 1, r.num_prompt_tokens) for r, p in at]
        assert np.array_equal(ctx.block_tables.numpy(), padded([r.block_ids for r in out.requests]))


# ---- the CUDA graphs' host side -------------------------------------------------------------------
class _NoGraph:
    def replay(self) -> None:
        pass


class _Model:
    def needs_per_length_rope(self, max_rope_length: int) -> bool:
        return False


def test_decode_graph_staging_holds_each_rows_table_as_batches_change(monkeypatch):
    """DecodeGraphs.run's host side, with its buffers on the CPU (no pinning) and a replay that does nothing."""
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, pin_memory=False, **k: zeros(*a, **k))
    graphs = cuda_graphs.DecodeGraphs(_Model(), (), max_batch_size=8, max_blocks_per_seq=32,
                                      device=torch.device("cpu"))
    monkeypatch.undo()
    graphs._graphs = {s: _NoGraph() for s in graphs.sizes}
    graphs._views = {s: torch.zeros(s, 3) for s in graphs.sizes}
    driver = Driver(3, num_blocks=60, max_batch_size=8, max_num_tokens=16, arrivals=0.08, drafts=0.0)
    replays = 0
    for out in driver.steps(300):
        batch = cuda_graphs.decode_batch(out, BS, _Model(), {})
        if batch is None or out.is_empty:
            continue
        graphs.run(batch)
        replays += 1
        n = len(out.requests)
        stage = graphs._inputs.last_staged  # the staging set this run filled (two take turns)
        for i, r in enumerate(out.requests):
            assert stage["tables"][i, :len(r.block_ids)].tolist() == list(r.block_ids)
            p = r.start_position
            assert stage["ints"][:, i].tolist() == [r.token_ids[0], p, max(p + 1, r.num_prompt_tokens),
                                                    r.block_ids[p // BS] * BS + p % BS, -1]
        assert stage["seq_lens"][:n].tolist() == [r.start_position + 1 for r in out.requests]
        assert torch.equal(graphs._tables[:n], stage["tables"][:n])  # what the graph reads
    assert replays > 50


def test_prefill_graph_staging_equals_the_packed_step_of_one_sequence():
    """PrefillGraphs.run's host side against pack_step, for the single-sequence steps of a scheduler run
    (first chunks, later chunks, prefix-cache hits), with its buffers on the CPU and a replay that does
    nothing: the real tokens as packed, the padding writing nothing and outside the sequence."""
    config = ModelConfig("LlamaForCausalLM", 32, 8, 16, 1, 2, 1, 4, 1e-6, 64, RopeConfig())
    cache = KVCache(config, 8, BS, torch.float32, torch.device("cpu"))
    graphs = prefill_graphs.PrefillGraphs(_Model(), (), max_num_tokens=16, max_blocks_per_seq=32, block_size=BS,
                                          device=torch.device("cpu"))
    assert graphs.sizes == [16]
    graphs._graphs = {s: _NoGraph() for s in graphs.sizes}
    graphs._views = {s: torch.zeros(1, 3) for s in graphs.sizes}
    driver = Driver(5, num_blocks=60, max_batch_size=1, max_num_tokens=16, arrivals=0.3, drafts=0.0)
    runs = 0
    for out in driver.steps(300):
        batch = prefill_graphs.prefill_batch(out, _Model(), {}, None)
        if batch is None:
            assert out.is_empty or len(out.requests[0].token_ids) == 1
            continue
        assert graphs.run(batch).shape == (batch.num_sampled, 3)
        runs += 1
        n, stage = len(batch), graphs._inputs.last_staged
        packed = pack_step(out, BS, cache.layers, torch.device("cpu"), mirror=BlockTableMirror())
        ctx = packed.context
        ints = stage["ints"]
        assert ints[0, :n].tolist() == packed.input_ids.tolist()
        for row, name in ((1, "positions"), (2, "rope_lengths"), (3, "slot_mapping")):
            assert ints[row, :n].tolist() == getattr(ctx, name).tolist(), name
        assert ints[3, n:].eq(-1).all()  # padding writes nothing
        assert stage["lens"].tolist() == [*ctx.seq_lens.tolist(), *ctx.query_start_loc.tolist()]
        assert stage["sample"].tolist() == [n - 1]
        table = out.requests[0].block_ids
        assert stage["table"][0, :len(table)].tolist() == list(table)
    assert runs > 20
