"""BlockManager: allocation accounting, prefix caching (chain hash, never the last token), LRU eviction."""

from __future__ import annotations

import pytest

from kiln.runtime.core.block_manager import BlockManager, CachedPrefix

BS = 4  # block size used throughout
NO_PREFIX = CachedPrefix()


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def compute(bm: BlockManager, request_id: str, token_ids: list[int], prefix: CachedPrefix = NO_PREFIX) -> None:
    """What a request goes through when its whole prompt is computed in one step."""
    assert bm.allocate(request_id, len(token_ids), prefix)
    bm.cache_full_blocks(request_id, token_ids, len(token_ids))


def snapshot(bm: BlockManager, probes: list[list[int]]) -> tuple:
    """Everything observable about the manager, to check that a refused call changed nothing."""
    return (
        bm.num_free_blocks,
        bm.num_cached_blocks,
        {rid: list(t) for rid, t in bm._tables.items()},
        [bm.find_cached_prefix(p) for p in probes],
    )


# ---- construction and plain allocation ------------------------------------------------------------
@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 4)])
def test_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_blocks_needed_rounds_up():
    bm = BlockManager(8, BS)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grows_table_and_free_returns_every_block():
    bm = BlockManager(8, BS)
    assert bm.num_free_blocks == 8
    assert bm.allocate("a", 5)
    first = bm.block_table("a")
    assert len(first) == 2 and bm.num_free_blocks == 6
    assert bm.allocate("a", 9)  # grows in place: the first blocks stay
    assert bm.block_table("a")[:2] == first and len(bm.block_table("a")) == 3
    assert bm.allocate("a", 7)  # asking for fewer never shrinks
    assert len(bm.block_table("a")) == 3 and bm.num_free_blocks == 5
    assert bm.allocate("b", 16)
    assert bm.num_free_blocks == 1
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8
    assert bm.block_table("a") == () and bm.block_table("b") == ()


def test_allocate_exactly_all_blocks_then_refuses():
    bm = BlockManager(4, BS)
    assert bm.allocate("a", 16)
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate("b", 1)
    assert not bm.allocate("b", 1)
    assert bm.block_table("b") == ()


def test_refused_allocate_changes_nothing():
    bm = BlockManager(6, BS)
    compute(bm, "a", tokens(9))  # 3 blocks, 2 of them cached
    assert bm.allocate("b", 8)  # 2 more
    probes = [tokens(9), tokens(13)]
    before = snapshot(bm, probes)
    assert not bm.allocate("b", 8 + 2 * BS)  # needs 2 more, 1 free
    assert not bm.allocate("c", 2 * BS)
    assert snapshot(bm, probes) == before


def test_free_unknown_request_is_a_noop():
    bm = BlockManager(4, BS)
    bm.free("nobody")
    assert bm.num_free_blocks == 4


# ---- prefix caching -------------------------------------------------------------------------------
def test_num_free_blocks_counts_cached_but_unused_blocks():
    bm = BlockManager(8, BS)
    compute(bm, "a", tokens(12))
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 5
    bm.free("a")
    assert bm.num_cached_blocks == 3  # contents survive the free
    assert bm.num_free_blocks == 8  # ... yet they count as free


def test_cache_full_blocks_registers_only_full_computed_blocks():
    bm = BlockManager(8, BS)
    prompt = tokens(11)
    assert bm.allocate("a", 11)
    bm.cache_full_blocks("a", prompt, 3)
    assert bm.num_cached_blocks == 0
    bm.cache_full_blocks("a", prompt, 7)
    assert bm.num_cached_blocks == 1
    bm.cache_full_blocks("a", prompt, 11)
    assert bm.num_cached_blocks == 2  # the third block holds only 3 tokens
    bm.cache_full_blocks("a", prompt, 11)  # idempotent
    assert bm.num_cached_blocks == 2


def test_second_prompt_gets_exactly_the_shared_full_blocks():
    bm = BlockManager(16, BS)
    a = tokens(14)
    compute(bm, "a", a)
    a_blocks = bm.block_table("a")
    # Shares 2 full blocks and 2 more tokens, then differs.
    b = a[:10] + [900, 901, 902]
    prefix = bm.find_cached_prefix(b)
    assert prefix == CachedPrefix(tuple(a_blocks[:2]), 8)
    # Shares 1 full block plus a bit.
    assert bm.find_cached_prefix(a[:6] + [900, 901]) == CachedPrefix(tuple(a_blocks[:1]), 4)
    # Shares less than a block: nothing.
    assert bm.find_cached_prefix(a[:3] + [900] * 6) == CachedPrefix()
    # Differs in the first token: nothing, although later tokens match.
    assert bm.find_cached_prefix([999] + a[1:]) == CachedPrefix()

    free_before = bm.num_free_blocks
    assert bm.allocate("b", len(b), prefix)
    table = bm.block_table("b")
    assert table[:2] == a_blocks[:2]
    assert not set(table[2:]) & set(a_blocks)
    assert bm.num_free_blocks == free_before - (len(table) - 2)  # shared blocks cost nothing more


def test_prefix_never_covers_the_last_prompt_token():
    bm = BlockManager(8, BS)
    a = tokens(12)
    compute(bm, "a", a)
    blocks = bm.block_table("a")
    # The same 12 tokens are all cached, but the last one's logits are still needed: 2 blocks, not 3.
    assert bm.find_cached_prefix(a) == CachedPrefix(tuple(blocks[:2]), 8)
    assert bm.find_cached_prefix(a + [77]) == CachedPrefix(tuple(blocks), 12)
    assert bm.find_cached_prefix(a[:5]) == CachedPrefix(tuple(blocks[:1]), 4)
    assert bm.find_cached_prefix(a[:4]) == CachedPrefix()
    assert bm.find_cached_prefix(a[:1]) == CachedPrefix()
    assert bm.find_cached_prefix([]) == CachedPrefix()


def test_same_block_tokens_after_a_different_prefix_are_not_reused():
    bm = BlockManager(16, BS)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    compute(bm, "xy", x + y + [0])  # caches x, then y-after-x
    compute(bm, "z", z + [0])  # caches z as a first block
    # z matches; y follows z here, not x, so its chain hash differs and the match stops.
    found = bm.find_cached_prefix(z + y + [0])
    assert found == CachedPrefix((bm.block_table("z")[0],), 4)
    # y as a first block is not y-after-x either.
    assert bm.find_cached_prefix(y + [0]) == CachedPrefix()
    assert bm.find_cached_prefix(x + y + [0]).num_tokens == 8


def test_disabled_prefix_caching_never_matches():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    compute(bm, "a", tokens(12))
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(tokens(12) + [1]) == CachedPrefix()


def test_cached_prefix_only_starts_a_table():
    bm = BlockManager(8, BS)
    compute(bm, "a", tokens(9))
    prefix = bm.find_cached_prefix(tokens(9))
    assert bm.allocate("b", 2)
    with pytest.raises(ValueError):
        bm.allocate("b", 9, prefix)


def test_shared_blocks_are_ref_counted():
    bm = BlockManager(8, BS)
    a = tokens(9)
    compute(bm, "a", a)
    prefix = bm.find_cached_prefix(a[:8] + [50, 51])
    assert bm.allocate("b", 10, prefix)
    assert bm.num_free_blocks == 8 - 3 - 1
    bm.free("a")  # the 2 shared blocks stay with b
    assert bm.num_free_blocks == 8 - 3
    assert bm.block_table("b")[:2] == prefix.block_ids
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_concurrent_identical_blocks_are_registered_once():
    bm = BlockManager(8, BS)
    compute(bm, "a", tokens(9))
    compute(bm, "b", tokens(9))  # computed alongside a, without a prefix
    assert bm.num_cached_blocks == 2
    assert bm.find_cached_prefix(tokens(9)).block_ids == tuple(bm.block_table("a")[:2])
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8


# ---- LRU eviction ---------------------------------------------------------------------------------
def test_blocks_freed_longest_ago_are_evicted_first():
    bm = BlockManager(4, BS)
    old, new = tokens(8, 100), tokens(8, 200)
    compute(bm, "old", old)
    compute(bm, "new", new)
    old_blocks, new_blocks = bm.block_table("old"), bm.block_table("new")
    bm.free("old")
    bm.free("new")
    assert bm.find_cached_prefix(old + [0]).num_tokens == 8
    assert bm.find_cached_prefix(new + [0]).num_tokens == 8

    assert bm.allocate("c", 4)  # one block: the oldest freed is old's tail
    assert bm.block_table("c") == (old_blocks[1],)
    assert bm.find_cached_prefix(old + [0]).num_tokens == 4  # first block still matches
    assert bm.allocate("c", 8)
    assert bm.block_table("c") == (old_blocks[1], old_blocks[0])
    assert bm.find_cached_prefix(old + [0]) == CachedPrefix()  # evicted: no longer matches
    assert bm.find_cached_prefix(new + [0]) == CachedPrefix(tuple(new_blocks), 8)
    assert bm.num_cached_blocks == 2


def test_reusing_a_cached_block_refreshes_it():
    bm = BlockManager(4, BS)
    a, b = tokens(4, 100) + [0], tokens(4, 200) + [0]
    compute(bm, "a", a)
    compute(bm, "b", b)
    bm.free("a")
    bm.free("b")  # a's blocks were freed before b's
    compute(bm, "a2", a, bm.find_cached_prefix(a))  # a's block is taken again, then freed last
    bm.free("a2")
    assert bm.allocate("fill", 3 * BS)  # evicts the 3 least recently freed
    assert bm.find_cached_prefix(b) == CachedPrefix()
    assert bm.find_cached_prefix(a).num_tokens == 4


def test_a_requests_tail_is_evicted_before_its_shared_prefix():
    bm = BlockManager(5, BS)
    prompt = tokens(13)  # 4 blocks, 3 of them full
    compute(bm, "a", prompt)
    blocks = bm.block_table("a")
    bm.free("a")
    # One never-used block is oldest; then a's blocks come back last-first.
    assert bm.allocate("x", 2 * BS)
    assert blocks[3] in bm.block_table("x")  # the partial tail goes first
    assert bm.find_cached_prefix(prompt).block_ids == tuple(blocks[:3])
    assert bm.allocate("x", 3 * BS)
    assert bm.block_table("x")[-1] == blocks[2]
    assert bm.find_cached_prefix(prompt).block_ids == tuple(blocks[:2])


def test_shared_prefix_outlives_the_tails_of_requests_that_used_it():
    bm = BlockManager(6, BS)
    system = tokens(8, 500)
    compute(bm, "a", system + [1, 2, 3, 4, 5])
    compute(bm, "b", system + [6, 7, 8, 9, 10], bm.find_cached_prefix(system + [6, 7, 8, 9, 10]))
    shared = bm.block_table("a")[:2]
    assert bm.block_table("b")[:2] == shared
    assert bm.num_free_blocks == 0
    bm.free("a")
    bm.free("b")
    # 4 blocks of tails go before the 2 shared blocks.
    assert bm.allocate("x", 4 * BS)
    assert not set(bm.block_table("x")) & set(shared)
    assert bm.find_cached_prefix(system + [0]).block_ids == tuple(shared)


# ---- a cached prefix whose blocks are free --------------------------------------------------------
def test_allocate_counts_free_cached_prefix_blocks_against_free_memory():
    bm = BlockManager(4, BS)
    a = tokens(9)  # blocks 0, 1 full and cached; 2 partial
    compute(bm, "a", a)
    bm.free("a")
    assert bm.allocate("x", 1)  # takes the never-used block
    assert bm.num_free_blocks == 3

    longer = a[:8] + tokens(5, 50)  # 13 tokens: 2 cached + 2 new blocks = 4 > 3 free
    prefix = bm.find_cached_prefix(longer)
    assert prefix.num_tokens == 8
    assert not bm.can_allocate("b", len(longer), prefix)
    before = snapshot(bm, [longer])
    assert not bm.allocate("b", len(longer), prefix)
    assert snapshot(bm, [longer]) == before

    shorter = a[:8] + tokens(4, 50)  # 12 tokens: 2 cached + 1 new block = 3 free
    prefix = bm.find_cached_prefix(shorter)
    assert bm.can_allocate("b", len(shorter), prefix)
    assert bm.allocate("b", len(shorter), prefix)
    assert bm.block_table("b")[:2] == prefix.block_ids
    assert bm.num_free_blocks == 0


def test_prefix_blocks_in_use_cost_no_free_memory():
    bm = BlockManager(4, BS)
    a = tokens(9)
    compute(bm, "a", a)  # 3 blocks held, 1 free
    prefix = bm.find_cached_prefix(a[:8] + [7, 7, 7, 7])  # 12 tokens: 2 shared + 1 new
    assert bm.allocate("b", 12, prefix)
    assert bm.num_free_blocks == 0


def test_reset_prefix_cache_forgets_only_unused_blocks():
    bm = BlockManager(8, BS)
    compute(bm, "a", tokens(9))
    compute(bm, "b", tokens(9, 100))
    bm.free("a")
    bm.reset_prefix_cache()
    assert bm.find_cached_prefix(tokens(9)) == CachedPrefix()
    assert bm.find_cached_prefix(tokens(9, 100)).num_tokens == 8
    assert bm.num_cached_blocks == 2
    assert bm.num_free_blocks == 5


def test_preempted_request_finds_its_own_blocks_again():
    bm = BlockManager(8, BS)
    history = tokens(10)  # prompt plus generated tokens
    compute(bm, "a", history)
    blocks = bm.block_table("a")
    bm.free("a")
    prefix = bm.find_cached_prefix(history)
    assert prefix == CachedPrefix(tuple(blocks[:2]), 8)
    assert bm.allocate("a", len(history), prefix)
    assert bm.block_table("a")[:2] == blocks[:2]
    # Caching continues from the prefix's hashes: the next full block registers.
    bm.cache_full_blocks("a", history + [10, 11], 12)
    assert bm.find_cached_prefix(history + [10, 11, 12]).num_tokens == 12
