"""Scheduler with the block manager, driven by a simulated engine loop (no model, no torch).

The simulated model keeps a fake KV cache: the slot of position p holds a key that chains every token up to
p, and a sampled token is derived from the key of the last position, read through the block table. So a
request's outputs are a deterministic function of its token history *as the KV cache holds it*: wrong
positions, stale or wrongly shared blocks, lost or duplicated tokens all change the outputs, which are
compared with a reference computed for the request alone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.capacity import capacity_policy
from kiln.runtime.core.request import Request, RequestStatus
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.core.scheduler import Scheduler, SchedulerLimits, SchedulerOutput

VOCAB = 1000


def chain_key(previous: int, token: int) -> int:
    """The fake KV of a position: depends on its token and, through `previous`, on every token before."""
    return hash((previous, token))


def reference_output(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """What a request generates when it runs alone, computed without the scheduler."""
    key = 0
    for t in prompt:
        key = chain_key(key, t)
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(key % VOCAB)
        key = chain_key(key, out[-1])
    return out


class Sim:
    """The engine loop around one Scheduler, checking invariants at every step."""

    def __init__(self, num_blocks: int, block_size: int, max_batch_size: int = 64, max_num_tokens: int = 4096,
                 prefix_caching: bool = True, policy: str = "max_utilization") -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(SchedulerLimits(max_batch_size, max_num_tokens), self.bm, capacity_policy(policy, self.bm))
        self.bs = block_size
        self.kv: dict[tuple[int, int], int] = {}  # (block id, offset) -> chain key written there
        self.arrival: dict[str, int] = {}
        self.requests: dict[str, Request] = {}
        self.finished: dict[str, Request] = {}
        self.outputs: list[SchedulerOutput] = []
        self.num_preemptions = 0
        self._keys: dict[str, list[int]] = {}  # request id -> chain keys of its tokens so far

    # ---- driving -------------------------------------------------------------------------------
    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int, **params) -> Request:
        request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params))
        self.sched.add_request(request)
        self.arrival[request_id] = len(self.arrival)
        self.requests[request_id] = request
        return request

    def abort(self, request_id: str) -> None:
        request = self.sched.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        assert request is not None and request.status == RequestStatus.FINISHED_ABORTED
        assert self.bm.block_table(request_id) == ()
        self.finished[request_id] = request

    def step(self, abort_during: Sequence[str] = ()) -> SchedulerOutput:
        running_before = [r.request_id for r in self.sched.running]
        out = self.sched.schedule()
        self.outputs.append(out)
        self.check_output(out, running_before)
        sampled = self.run_model(out)
        for request_id in abort_during:  # the step was already running when these were aborted
            self.abort(request_id)
        self.sched.update_after_step(out, {rid: [token] for rid, token in sampled.items()})
        for request_id in sampled:
            request = self.sched.get(request_id)
            if request is not None and len(request.output_token_ids) >= request.sampling_params.max_tokens:
                done = self.sched.finish_request(request_id, RequestStatus.FINISHED_LENGTH)
                self.finished[request_id] = done
        self.check_state()
        return out

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished(), "no progress: requests left after max_steps"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(self.bm.block_table(rid) == () for rid in self.requests)

    def run_model(self, out: SchedulerOutput) -> dict[str, int]:
        """Writes each scheduled token's fake KV through the block table; samples where asked."""
        sampled = {}
        for item in out.requests:
            key = self.kv[self._slot(item.block_ids, item.start_position - 1)] if item.start_position else 0
            for i, token in enumerate(item.token_ids):
                key = chain_key(key, token)
                self.kv[self._slot(item.block_ids, item.start_position + i)] = key
            if item.sample:
                sampled[item.request_id] = key % VOCAB
        return sampled

    def _slot(self, block_ids: Sequence[int], position: int) -> tuple[int, int]:
        return block_ids[position // self.bs], position % self.bs

    def keys(self, request: Request) -> list[int]:
        keys = self._keys.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        for t in tokens[len(keys):]:
            keys.append(chain_key(keys[-1] if keys else 0, t))
        return keys

    # ---- checks --------------------------------------------------------------------------------
    def check_output(self, out: SchedulerOutput, running_before: list[str]) -> None:
        limits = self.sched.limits
        assert len(out.requests) <= limits.max_batch_size
        assert out.num_tokens <= limits.max_num_tokens
        ids = [item.request_id for item in out.requests]
        assert len(set(ids)) == len(ids)

        # Preemption takes the most recently arrived running requests, latest first, and puts them back at
        # the front of the queue in arrival order; nothing new starts in such a step.
        k = len(out.preempted_ids)
        if k:
            assert list(out.preempted_ids) == running_before[::-1][:k]
            assert [r.request_id for r in list(self.sched.waiting)[:k]] == running_before[-k:]
            assert not set(ids) - set(running_before)
        self.num_preemptions += k
        for request_id in out.preempted_ids:
            request = self.sched.get(request_id)
            assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
            assert request_id not in ids

        for item in out.requests:
            request = self.sched.get(item.request_id)
            assert request.status == RequestStatus.RUNNING
            start, n = item.start_position, len(item.token_ids)
            assert n >= 1
            assert start == request.num_computed_tokens
            assert list(item.token_ids) == request.all_token_ids[start:start + n]
            assert item.sample == (start + n == request.num_tokens)
            assert item.num_prompt_tokens == request.num_prompt_tokens
            assert item.block_ids == self.bm.block_table(item.request_id)
            assert len(item.block_ids) * self.bs >= start + n  # the table covers what is written
            # What the step attends to is already in the cache, and correct (catches bad prefix hits).
            keys = self.keys(request)
            for p in range(start):
                assert self.kv.get(self._slot(item.block_ids, p)) == keys[p], (item.request_id, p)
            # It writes only into blocks that no other live request holds.
            written = {item.block_ids[p // self.bs] for p in range(start, start + n)}
            for other in self.live():
                if other.request_id != item.request_id:
                    assert not written & set(self.bm.block_table(other.request_id))

    def live(self) -> list[Request]:
        return list(self.sched.running) + list(self.sched.waiting)

    def check_state(self) -> None:
        sched, bm = self.sched, self.bm
        live = self.live()
        # First come, first served: running then waiting is always in arrival order.
        order = [self.arrival[r.request_id] for r in live]
        assert order == sorted(order) and len(set(order)) == len(order)
        for request_id, request in self.requests.items():
            assert (sched.get(request_id) is request) == (request_id not in self.finished)

        holders: dict[int, list[Request]] = {}
        for request in sched.waiting:
            assert request.status == RequestStatus.WAITING
            assert request.num_computed_tokens == 0
            assert bm.block_table(request.request_id) == ()
        for request in sched.running:
            assert request.status == RequestStatus.RUNNING
            table = bm.block_table(request.request_id)
            assert len(table) * self.bs >= request.num_computed_tokens
            assert request.num_computed_tokens < request.num_tokens  # it has something left to compute
            assert len(request.output_token_ids) < request.sampling_params.max_tokens
            for block_id in table:
                holders.setdefault(block_id, []).append(request)
            keys = self.keys(request)
            for p in range(request.num_computed_tokens):
                assert self.kv.get(self._slot(table, p)) == keys[p]
        for request in self.finished.values():
            assert bm.block_table(request.request_id) == ()

        # Every block is either held or free; shared blocks are counted once, by reference count.
        assert len(holders) + bm.num_free_blocks == bm.num_blocks
        for block_id in range(bm.num_blocks):
            assert bm._blocks[block_id].ref_count == len(holders.get(block_id, []))
        # A block in two live tables is a cached prefix block, at the same place in each table.
        for block_id, owners in holders.items():
            if len(owners) < 2:
                continue
            places = {bm.block_table(r.request_id).index(block_id) for r in owners}
            assert len(places) == 1
            place = places.pop()
            for r in owners:
                assert bm.find_cached_prefix(r.all_token_ids).block_ids[place] == block_id

    def check_outputs(self) -> None:
        for request_id, request in self.finished.items():
            expected = reference_output(request.prompt_token_ids, request.sampling_params.max_tokens)
            if request.status == RequestStatus.FINISHED_ABORTED:
                assert request.output_token_ids == expected[:len(request.output_token_ids)]
            else:
                assert request.status == RequestStatus.FINISHED_LENGTH
                assert request.output_token_ids == expected, request_id


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def single_steps(sim: Sim) -> list[tuple[int, int, bool, int]]:
    """(start, num tokens, sample, table length) of each step's only request."""
    rows = []
    while sim.sched.has_unfinished():
        out = sim.step()
        (item,) = out.requests
        rows.append((item.start_position, len(item.token_ids), item.sample, len(item.block_ids)))
    return rows


# ---- requests and limits ---------------------------------------------------------------------------
def test_limits_are_validated():
    with pytest.raises(ValueError):
        SchedulerLimits(max_batch_size=0, max_num_tokens=8)
    with pytest.raises(ValueError):
        SchedulerLimits(max_batch_size=1, max_num_tokens=0)


def test_duplicate_request_id_raises():
    sim = Sim(16, 4)
    sim.add("a", [1, 2, 3], 2)
    with pytest.raises(ValueError, match="'a'"):
        sim.sched.add_request(Request("a", [4, 5], SamplingParams()))
    sim.step()  # running now
    with pytest.raises(ValueError):
        sim.sched.add_request(Request("a", [4, 5], SamplingParams()))
    assert len(sim.sched.running) == 1 and not sim.sched.waiting
    sim.run()
    sim.check_outputs()


def test_empty_scheduler_schedules_nothing():
    sim = Sim(4, 4)
    out = sim.sched.schedule()
    assert out.is_empty and out.num_tokens == 0 and out.preempted_ids == ()
    assert sim.sched.finish_request("nobody", RequestStatus.FINISHED_ABORTED) is None


def test_prefill_then_decode_one_token_per_step():
    sim = Sim(16, 4)
    sim.add("a", list(range(10)), 3)
    assert single_steps(sim) == [(0, 10, True, 3), (10, 1, True, 3), (11, 1, True, 3)]
    sim.run()
    sim.check_outputs()
    assert len(sim.finished["a"].output_token_ids) == 3


def test_long_prompt_is_chunked_with_correct_positions():
    sim = Sim(16, 4, max_num_tokens=8)
    sim.add("a", prompt_of(23, 1), 3)
    assert single_steps(sim) == [(0, 8, False, 2), (8, 8, False, 4), (16, 7, True, 6), (23, 1, True, 6),
                                 (24, 1, True, 7)]
    sim.run()
    sim.check_outputs()


def test_new_requests_join_while_others_decode():
    sim = Sim(32, 4, max_num_tokens=4)
    sim.add("a", prompt_of(3, 1), 8)
    sim.step()
    sim.step()
    sim.add("b", prompt_of(10, 2), 2)
    out = sim.step()  # a decodes; b's prompt takes the rest of the budget
    assert [(r.request_id, r.start_position, len(r.token_ids)) for r in out.requests] == [("a", 4, 1), ("b", 0, 3)]
    out = sim.step()
    assert [(r.request_id, r.start_position, len(r.token_ids)) for r in out.requests] == [("a", 5, 1), ("b", 3, 3)]
    sim.run()
    sim.check_outputs()


@pytest.mark.parametrize("max_batch_size, max_num_tokens", [(1, 4096), (2, 4096), (3, 7), (8, 5), (64, 1)])
def test_batch_size_and_token_budget_are_never_exceeded(max_batch_size, max_num_tokens):
    sim = Sim(256, 4, max_batch_size, max_num_tokens)
    for i in range(10):
        sim.add(f"r{i}", prompt_of(3 + 2 * i, i), 1 + i % 4)
    sim.run()  # the limits are checked at every step
    sim.check_outputs()
    if max_num_tokens > 100:  # batch size is the binding limit
        assert max(len(o.requests) for o in sim.outputs) == max_batch_size
    else:  # the token budget is, and it is used to the full while prompts wait
        assert max(o.num_tokens for o in sim.outputs) == max_num_tokens


def test_fcfs_the_head_of_the_queue_is_never_overtaken():
    sim = Sim(4, 4)
    sim.add("a", prompt_of(10, 1), 2)
    sim.step()  # a holds 3 of the 4 blocks
    sim.add("b", prompt_of(6, 2), 1)  # needs 2 blocks
    sim.add("c", prompt_of(2, 3), 1)  # needs 1: would fit, but b came first
    out = sim.step()
    assert [r.request_id for r in out.requests] == ["a"]
    assert [r.request_id for r in sim.sched.waiting] == ["b", "c"]
    out = sim.step()  # a finished and freed its blocks
    assert [r.request_id for r in out.requests] == ["b", "c"]
    sim.run()
    sim.check_outputs()


def test_fcfs_with_batch_size_limit_admits_in_arrival_order():
    sim = Sim(64, 4, max_batch_size=2)
    for i in range(6):
        sim.add(f"r{i}", prompt_of(4, i), 3)
    first_step: dict[str, int] = {}
    step = 0
    while sim.sched.has_unfinished():
        for item in sim.step().requests:
            first_step.setdefault(item.request_id, step)
        step += 1
    order = sorted(first_step, key=lambda rid: (first_step[rid], sim.arrival[rid]))
    assert order == [f"r{i}" for i in range(6)]
    assert [first_step[f"r{i}"] for i in range(6)] == sorted(first_step.values())
    sim.check_outputs()


# ---- prefix caching through the scheduler ----------------------------------------------------------
def test_a_later_prompt_starts_after_the_cached_prefix():
    sim = Sim(16, 4)
    system = prompt_of(8, 7)
    sim.add("a", system + [1, 2], 3)
    sim.step()
    a_blocks = sim.bm.block_table("a")[:2]
    sim.add("b", system + [3, 4, 5], 2)  # while a still runs: its first 2 blocks are shared
    out = sim.step()
    item = {r.request_id: r for r in out.requests}["b"]
    assert (item.start_position, item.token_ids) == (8, (3, 4, 5))
    assert item.block_ids[:2] == a_blocks
    assert sim.sched.get("b").num_cached_prompt_tokens == 8
    sim.run()
    sim.add("c", system + [9], 1)  # after both finished: the blocks are free but still cached
    out = sim.step()
    assert (out.requests[0].start_position, out.requests[0].block_ids[:2]) == (8, a_blocks)
    sim.run()
    sim.check_outputs()
    assert sim.bm.prefix_hit_tokens == 16
    assert sim.bm.prefix_query_tokens == 10 + 11 + 9


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sim = Sim(16, 4)
    prompt = prompt_of(8, 3)
    sim.add("a", prompt, 1)
    sim.run()
    sim.add("b", prompt, 2)
    out = sim.step()
    # Blocks are the unit of reuse: the last full block holds the last token, so it is recomputed.
    assert (out.requests[0].start_position, out.requests[0].token_ids, out.requests[0].sample) == (
        4, tuple(prompt[4:]), True)
    sim.run()
    sim.check_outputs()


def test_blocks_of_generated_tokens_are_cached_too():
    sim = Sim(32, 4)
    sim.add("a", prompt_of(6, 1), 7)  # 13 tokens; the last one is sampled but never computed
    sim.run()
    a = sim.finished["a"]
    sim.add("b", a.all_token_ids + [5, 6], 1)  # a follow-up turn: the conversation so far, then more
    out = sim.step()
    assert out.requests[0].start_position == 12
    assert sim.requests["b"].num_cached_prompt_tokens == 12
    sim.run()
    sim.check_outputs()


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    sim = Sim(16, 4)
    prompt = prompt_of(9, 3)
    sim.add("a", prompt, 1)
    sim.run()
    sim.add("b", prompt, 1, prompt_logprobs=True)
    out = sim.step()
    assert out.requests[0].start_position == 0 and len(out.requests[0].token_ids) == 9
    sim.run()
    sim.check_outputs()


# ---- preemption ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_under_tight_memory_loses_and_duplicates_nothing(prefix_caching):
    sim = Sim(8, 4, max_batch_size=8, max_num_tokens=64, prefix_caching=prefix_caching)
    for i in range(6):
        sim.add(f"r{i}", prompt_of(5 + i % 3, 10 + i), 10)  # 15..17 tokens at most: 4 or 5 blocks each
    first = sim.step()
    assert [r.request_id for r in first.requests] == ["r0", "r1", "r2", "r3"]  # 2 blocks each: memory is full

    history: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
    first_preemption = None
    while sim.sched.has_unfinished():
        running = [r.request_id for r in sim.sched.running]
        out = sim.step()
        if out.preempted_ids and first_preemption is None:
            first_preemption = (running, out.preempted_ids, [r.request_id for r in sim.sched.waiting])
        for item in out.requests:
            history.setdefault(item.request_id, []).append((item.start_position, item.token_ids))
    assert sim.num_preemptions > 0
    running, preempted, waiting = first_preemption
    assert preempted[0] == running[-1]  # the most recently arrived running request
    assert waiting[:len(preempted)] == sorted(preempted)  # back at the front, ahead of r4 and r5

    # A preempted request is recomputed from scratch (or from what the prefix cache still has), generated
    # tokens included: the first chunk after a preemption starts at a block boundary and re-feeds them.
    for request_id in {rid for o in sim.outputs for rid in o.preempted_ids}:
        request = sim.finished[request_id]
        for i, (start, token_ids) in enumerate(history[request_id]):
            if i and start < history[request_id][i - 1][0] + len(history[request_id][i - 1][1]):
                assert start % 4 == 0
                assert start == 0 or prefix_caching
                assert token_ids == tuple(request.all_token_ids[start:start + len(token_ids)])
                assert start + len(token_ids) > request.num_prompt_tokens  # generated tokens re-fed
    sim.run()
    sim.check_outputs()  # exactly max_tokens each, the same as alone
    assert all(len(r.output_token_ids) == 10 for r in sim.finished.values())


def test_guaranteed_no_evict_never_preempts_and_admits_in_arrival_order():
    """The same tight memory as above under guaranteed_no_evict: a request starts only once its whole length
    (prompt + max_tokens) fits beside the running ones' reservations, so nobody is preempted, the head of the
    queue is never overtaken, and every output is what the request generates alone."""
    sim = Sim(8, 4, max_batch_size=8, max_num_tokens=64, policy="guaranteed_no_evict")
    for i in range(6):
        sim.add(f"r{i}", prompt_of(5 + i % 3, 10 + i), 10)  # 15, 16, 17 tokens: 4, 4, 5 blocks reserved
    first = sim.step()
    assert [r.request_id for r in first.requests] == ["r0", "r1"]  # 8 blocks reserved: r2 waits
    started = []
    while sim.sched.has_unfinished():
        before = {r.request_id for r in sim.sched.running}
        out = sim.step()
        assert not out.preempted_ids
        started += [r.request_id for r in out.requests if r.request_id not in before]
        assert sim.sched.policy.num_reserved <= sim.bm.num_blocks
    assert sim.num_preemptions == 0 and started == ["r2", "r3", "r4", "r5"]
    assert sim.sched.policy.num_reserved == 0
    sim.check_outputs()


def test_guaranteed_no_evict_releases_an_aborted_requests_reservation():
    sim = Sim(8, 4, policy="guaranteed_no_evict")
    sim.add("big", prompt_of(8, 1), 20)  # 28 tokens: 7 blocks
    sim.add("small", prompt_of(4, 2), 4)  # 2 blocks: waits behind big's reservation
    assert [r.request_id for r in sim.step().requests] == ["big"]
    sim.abort("big")
    assert [r.request_id for r in sim.step().requests] == ["small"]
    sim.run()


def test_an_unknown_capacity_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="capacity_scheduler_policy='fifo' is not one of max_utilization, "
                                         "guaranteed_no_evict"):
        capacity_policy("fifo", BlockManager(4, 4))


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_latest():
    sim = Sim(4, 4, max_num_tokens=64, prefix_caching=False)
    sim.add("a", prompt_of(7, 1), 6)  # up to 13 tokens: 4 blocks
    sim.add("b", prompt_of(7, 2), 6)
    sim.step()  # both admitted, 2 blocks each
    sim.step()  # both decode position 7 into their second block
    out = sim.step()  # a needs a third block: b, the latest, is preempted
    assert out.preempted_ids == ("b",) and [r.request_id for r in out.requests] == ["a"]
    sim.run()
    sim.check_outputs()


def test_a_preempted_request_resumes_from_its_own_cached_blocks():
    sim = Sim(6, 4, max_num_tokens=64)
    sim.add("a", prompt_of(7, 1), 10)  # up to 17 tokens: 5 of the 6 blocks
    b = sim.add("b", prompt_of(7, 2), 8)
    restart = None
    while sim.sched.has_unfinished():
        was_preempted = b.num_preemptions > 0 and b.status == RequestStatus.WAITING
        out = sim.step()
        items = [r for r in out.requests if r.request_id == "b"]
        if was_preempted and items and restart is None:
            restart = items[0]
    assert b.num_preemptions >= 1 and restart is not None
    # b's blocks went back to the free queue last-first: a's growth took b's third block, and b's first
    # two (its prompt and its first generated token) were still cached when b came back.
    assert restart.start_position == 8 > b.num_prompt_tokens
    assert restart.token_ids == tuple(b.all_token_ids[8:8 + len(restart.token_ids)])
    sim.check_outputs()


def test_outputs_do_not_depend_on_limits_or_memory():
    rng = random.Random(1234)
    systems = [prompt_of(8, 100), prompt_of(5, 101)]
    jobs = []
    for i in range(14):
        prompt = rng.choice(systems)[:rng.randrange(0, 9)] + prompt_of(rng.randrange(1, 10), 200 + i)
        jobs.append((f"r{i}", prompt, rng.randrange(1, 32 - len(prompt))))
    configs = {
        "loose": dict(num_blocks=1000, block_size=4),
        "tight": dict(num_blocks=8, block_size=4, max_batch_size=3, max_num_tokens=5),
        "tight, no prefix caching": dict(num_blocks=8, block_size=4, max_batch_size=4, max_num_tokens=6,
                                          prefix_caching=False),
        "one at a time": dict(num_blocks=8, block_size=4, max_batch_size=1, max_num_tokens=3),
        "block size 1": dict(num_blocks=32, block_size=1, max_batch_size=5, max_num_tokens=9),
    }
    results = {}
    for name, config in configs.items():
        sim = Sim(**config)
        for i, (request_id, prompt, max_tokens) in enumerate(jobs):
            sim.add(request_id, prompt, max_tokens)
            if i % 3 == 2:  # arrivals spread over the first steps
                sim.step()
        sim.run()
        sim.check_outputs()
        results[name] = {rid: r.output_token_ids for rid, r in sim.finished.items()}
        if name.startswith("tight"):
            assert sim.num_preemptions > 0, name
    expected = {rid: reference_output(prompt, n) for rid, prompt, n in jobs}
    for name, outputs in results.items():
        assert outputs == expected, name


# ---- abort ----------------------------------------------------------------------------------------
def test_abort_waiting_and_running_requests_frees_their_blocks():
    sim = Sim(4, 4)
    sim.add("a", prompt_of(9, 1), 4)
    sim.add("b", prompt_of(9, 2), 4)  # does not fit next to a
    sim.step()
    assert [r.request_id for r in sim.sched.running] == ["a"]
    assert sim.bm.num_free_blocks == 1
    sim.abort("b")  # waiting
    assert not sim.sched.waiting and sim.bm.num_free_blocks == 1
    sim.abort("a")  # running
    assert not sim.sched.has_unfinished()
    assert sim.bm.num_free_blocks == 4
    assert sim.sched.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
    sim.check_state()
    sim.check_outputs()


def test_abort_while_the_step_runs_is_ignored_by_the_update():
    sim = Sim(8, 4)
    sim.add("a", prompt_of(6, 1), 5)
    sim.add("b", prompt_of(6, 2), 5)
    sim.step()
    sim.step(abort_during=["a"])  # a's sampled token arrives after it was aborted
    assert sim.finished["a"].output_token_ids == reference_output(sim.finished["a"].prompt_token_ids, 5)[:1]
    assert [r.request_id for r in sim.sched.running] == ["b"]
    sim.run()
    sim.check_outputs()


# ---- randomized ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(10))
def test_random_traffic_keeps_every_invariant(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randrange(6, 24)
    capacity = num_blocks * block_size
    sim = Sim(num_blocks, block_size, max_batch_size=rng.randrange(1, 9), max_num_tokens=rng.randrange(1, 40),
              prefix_caching=seed % 3 != 2)
    systems = [prompt_of(rng.randrange(1, 20), 1000 * seed + i) for i in range(3)]
    next_id = 0
    for _ in range(300):
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
            prefix = rng.choice(systems)[:rng.randrange(0, 20)] if rng.random() < 0.6 else []
            prompt = (prefix + prompt_of(rng.randrange(1, 20), rng.randrange(10**9)))[:capacity - 1]
            sim.add(f"r{next_id}", prompt, rng.randrange(1, min(24, capacity - len(prompt) + 1)))
            next_id += 1
        live = [r.request_id for r in sim.live()]
        if live and rng.random() < 0.08:
            sim.abort(rng.choice(live))
        during = []
        if sim.sched.running and rng.random() < 0.04:
            during = [rng.choice(sim.sched.running).request_id]
        sim.step(abort_during=during)
    sim.run()
    sim.check_outputs()
    assert next_id > 50 and len(sim.finished) == next_id
