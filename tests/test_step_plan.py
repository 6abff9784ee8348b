"""The step plan of the CPU references (plugins/step_plan.py): worked out once per step and shared by every
layer, it gives the same attention and KV writes as the references without one; a lone sequence in
consecutive blocks is read in place; a plan is refused for tensors it was not made from."""

from __future__ import annotations

import pytest
import torch
from test_attention_reference import _dense

from kiln.plugins import paged_attention
from kiln.plugins.kv_cache import write_kv_cache
from kiln.plugins.step_plan import step_plan


def _cache(num_blocks, block_size=4, kv_heads=2, dim=16, dtype=torch.float32):
    # Slots no sequence owns hold NaN: reading one shows.
    k = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    return k, k.clone()


@pytest.mark.parametrize("new", [1, 6], ids=["decode", "chunk"])
@pytest.mark.parametrize("sliding_window", [0, 5])
def test_a_lone_sequence_in_consecutive_blocks_is_read_in_place_and_matches_dense(new, sliding_window):
    torch.manual_seed(0)
    length, block_size, heads, kv_heads, dim = 14, 4, 6, 2, 16
    k_cache, v_cache = _cache(8)
    table = [3, 4, 5, 6]  # consecutive: slots 12..27 hold positions 0..13 (block 6 partly)
    k, v = torch.randn(length, kv_heads, dim), torch.randn(length, kv_heads, dim)
    for p in range(length):
        k_cache[table[p // block_size], p % block_size] = k[p]
        v_cache[table[p // block_size], p % block_size] = v[p]
    q = torch.randn(new, heads, dim)
    tables = torch.tensor([table], dtype=torch.int32)
    lens = torch.tensor([length], dtype=torch.int32)
    starts = torch.tensor([0, new], dtype=torch.int32)
    slots = torch.arange(length - new, length) + table[0] * block_size
    plan = step_plan(tables, lens, starts, slots, block_size)
    reads, _ = plan.attention.chunks[0][1].keys(sliding_window, kv_heads) if new > 1 else \
        plan.attention.decode.keys(sliding_window, kv_heads)
    # Read in place unless a window hides keys from every query (their slots then stand in for another's).
    assert isinstance(reads, slice) == (sliding_window == 0)
    out = paged_attention(q, k_cache, v_cache, tables, lens, starts, dim ** -0.5, sliding_window, plan=plan)
    torch.testing.assert_close(out, _dense(q, k, v, sliding_window), atol=1e-5, rtol=1e-5)
    assert torch.equal(out, paged_attention(q, k_cache, v_cache, tables, lens, starts, dim ** -0.5,
                                            sliding_window))


def test_one_plan_serves_every_layer_as_no_plan_would():
    """A mixed step (decodes, a chunk, a padding row with slot -1) through two layers' caches and two
    windows: with the shared plan, the writes and outputs equal the references' without one."""
    torch.manual_seed(1)
    block_size, heads, kv_heads, dim = 4, 4, 2, 16
    tables = torch.tensor([[1, 7, 0], [2, 5, 9], [4, 0, 0], [0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([6, 11, 3, 0], dtype=torch.int32)  # the last row: padding
    starts = torch.tensor([0, 1, 2, 5, 6], dtype=torch.int32)  # decode, decode, a 3-token chunk, padding
    positions = [5, 10, 0, 1, 2]
    slots = torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size
                          for s, p in zip([0, 1, 2, 2, 2], positions)] + [-1])
    plan = step_plan(tables, lens, starts, slots, block_size)
    assert plan.skips_slots
    for window in (0, 3):  # two layers
        caches = [torch.randn(10, block_size, kv_heads, dim) for _ in range(2)]
        planned = [c.clone() for c in caches]
        k, v = torch.randn(6, kv_heads, dim), torch.randn(6, kv_heads, dim)
        q = torch.randn(6, heads, dim)
        write_kv_cache(k, v, *caches, slots)
        write_kv_cache(k, v, *planned, slots, plan=plan)
        assert all(torch.equal(a, b) for a, b in zip(caches, planned))
        want = paged_attention(q, *caches, tables, lens, starts, 0.25, window)
        got = paged_attention(q, *planned, tables, lens, starts, 0.25, window, plan=plan)
        assert torch.equal(got, want)


def test_a_plan_made_from_other_tensors_is_refused():
    tables = torch.tensor([[1, 2]], dtype=torch.int32)
    lens, starts = torch.tensor([5], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    slots = torch.tensor([9])
    plan = step_plan(tables, lens, starts, slots, 4)
    k_cache, v_cache = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    q = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="plan was made for other"):
        paged_attention(q, k_cache, v_cache, tables.clone(), lens, starts, 0.25, plan=plan)
    with pytest.raises(ValueError, match="plan was made for another slot_mapping"):
        write_kv_cache(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), k_cache, v_cache, slots.clone(), plan=plan)
    assert step_plan(tables.to("meta"), lens.to("meta"), starts.to("meta"), slots.to("meta"), 4) is None
