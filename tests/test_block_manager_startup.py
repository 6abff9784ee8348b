"""BlockManager starts in O(1) (a small model on a big GPU has millions of blocks) and still hands blocks out in
the order a queue of every block id would: trimmed ones first, then never-used ones in id order, then freed
ones oldest-freed first."""

from __future__ import annotations

import random
import time

import pytest

from kiln.runtime.core.block_manager import BlockManager

BS = 4


def test_fifty_million_blocks_start_in_constant_time():
    start = time.perf_counter()
    bm = BlockManager(50_000_000, 16)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.05, f"BlockManager(50M blocks) took {elapsed * 1e3:.1f} ms"
    assert bm.num_free_blocks == 50_000_000
    assert bm.allocate("a", 40) and list(bm.block_table("a")) == [0, 1, 2]
    assert bm.num_free_blocks == 50_000_000 - 3
    assert bm._blocks[49_999_999].ref_count == 0  # an id never handed out reads as a fresh block
    with pytest.raises(IndexError, match="50000000"):
        bm._blocks[50_000_000]


def test_a_worked_example_of_the_order():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    assert bm.allocate("a", 8) and bm.allocate("b", 8)  # a: 0 1, b: 2 3
    bm.free("a")  # last block first: the queue is 4 5 6 7 1 0
    assert bm.allocate("b", 16)  # b grows by 4 5; the queue is 6 7 1 0
    bm.trim("b", 8)  # 5 then 4 go to the front: 4 5 6 7 1 0
    assert bm.allocate("c", 24) and list(bm.block_table("c")) == [4, 5, 6, 7, 1, 0]
    assert bm.num_free_blocks == 0 and not bm.allocate("d", 1)


class QueueModel:
    """The old BlockManager's free queue, literally: a list of every id, taken from the front, freed blocks
    appended (a table's last block first), trimmed ones put back at the front, cached ones taken from where
    they are."""

    def __init__(self, num_blocks: int) -> None:
        self.queue = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.tables: dict[str, list[int]] = {}

    def take(self, block_id: int) -> None:
        if self.refs[block_id] == 0:
            self.queue.remove(block_id)
        self.refs[block_id] += 1

    def fresh(self) -> int:
        block_id = self.queue.pop(0)
        self.refs[block_id] = 1
        return block_id

    def allocate(self, rid: str, num_tokens: int, prefix: tuple[int, ...]) -> bool:
        table = self.tables.get(rid, [])
        have = len(table) + len(prefix)
        new = max(0, -(-num_tokens // BS) - have)
        if new + sum(1 for b in prefix if self.refs[b] == 0) > len(self.queue):
            return False
        table = self.tables.setdefault(rid, [])
        for b in prefix:
            self.take(b)
            table.append(b)
        table += [self.fresh() for _ in range(new)]
        return True

    def free(self, rid: str) -> None:
        for b in reversed(self.tables.pop(rid)):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.queue.append(b)

    def trim(self, rid: str, num_tokens: int) -> None:
        keep = -(-num_tokens // BS)
        table = self.tables[rid]
        for b in reversed(table[keep:]):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.queue.insert(0, b)
        del table[keep:]


@pytest.mark.parametrize("seed", range(20))
def test_blocks_are_handed_out_as_a_queue_of_every_id_would(seed):
    rng = random.Random(seed)
    num_blocks = rng.randint(6, 40)
    bm, model = BlockManager(num_blocks, BS), QueueModel(num_blocks)
    shared = [[7] * 9, list(range(11)), []]  # prompt starts that the prefix cache serves
    live: dict[str, list[int]] = {}
    for step in range(150):
        op = rng.random()
        rid = rng.choice(sorted(live)) if live else None
        if op < 0.4 or rid is None:
            rid = f"r{step}"
            prompt = rng.choice(shared) + [rng.randint(0, 3) for _ in range(rng.randint(1, 9))]
            prefix = bm.find_cached_prefix(prompt)
            ok = bm.allocate(rid, len(prompt), prefix)
            assert ok == model.allocate(rid, len(prompt), prefix.block_ids)
            if ok:
                live[rid] = prompt
                bm.cache_full_blocks(rid, prompt, len(prompt))
        elif op < 0.65:  # decode a few draft tokens, then keep some of them
            grown = len(live[rid]) + rng.randint(1, 6)
            ok = bm.allocate(rid, grown)
            assert ok == model.allocate(rid, grown, ())
            if ok:
                kept = rng.randint(len(live[rid]), grown)
                bm.trim(rid, kept)
                model.trim(rid, kept)
        elif op < 0.9:
            bm.free(rid)
            model.free(rid)
            del live[rid]
        else:
            bm.reset_prefix_cache()
        assert {r: list(bm.block_table(r)) for r in live} == model.tables, f"seed {seed} step {step}"
        assert bm.num_free_blocks == len(model.queue)
        assert [bm._blocks[b].ref_count for b in range(num_blocks)] == model.refs
