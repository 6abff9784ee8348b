"""The host tier's bookkeeping in the block manager (plain Python): offers, in-flight blocks, loads, pins,
and the contents every block holds, simulated by a stand-in device and host that carry out the transfers."""

import pytest

from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.kv_tiers import HostTierIndex

BS = 4


class Memory:
    """What each device block and host slot holds (a block's chain hash), moved as the transfers say."""

    def __init__(self):
        self.device: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}

    def run(self, transfers):
        for block, slot in transfers.offloads:
            self.host[slot] = self.device[block]
        for slot, block in transfers.loads:
            self.device[block] = self.host[slot]


def compute(bm, mem, rid, tokens, lora=0):
    """Admits a prompt, 'computes' its uncached blocks (writing their hashes) and registers them."""
    prefix = bm.find_cached_prefix(tokens, lora)
    assert bm.allocate(rid, len(tokens), prefix)
    mem.run(bm.drain_transfers())
    hashes = bm.prefix_hashes(tokens + [0], lora)  # every full block of the prompt
    table = list(bm.block_table(rid))
    for i, h in enumerate(hashes):
        if i * BS >= prefix.num_tokens:
            mem.device[table[i]] = h
        assert mem.device[table[i]] == h, f"block {i} of {rid} holds another block's KV"
    bm.cache_full_blocks(rid, tokens, len(tokens), lora)
    return prefix


def prompt(seed, n=12):
    return [seed * 100 + i for i in range(n)]


def test_a_freed_block_goes_to_host_and_comes_back_after_eviction():
    bm = BlockManager(num_blocks=6, block_size=BS)
    bm.attach_host_tier(HostTierIndex(32))
    mem = Memory()
    first = prompt(1)
    compute(bm, mem, "a", first)
    bm.free("a")
    assert bm.num_free_blocks == 6  # in flight to the host, still counted free
    # Distinct prompts fill the device pool several times over: "a"'s blocks leave the device.
    for k in range(2, 8):
        compute(bm, mem, f"r{k}", prompt(k))
        bm.free(f"r{k}")
    again = compute(bm, mem, "a2", first + [7])
    assert again.num_tokens == 12 and again.num_host_tokens == 12 and not again.block_ids
    bm.free("a2")
    bm.drain_transfers()
    assert bm.num_free_blocks == 6 and len(bm.host) <= 32


def test_in_flight_blocks_are_handed_out_last_and_the_step_waits():
    bm = BlockManager(num_blocks=3, block_size=BS)
    bm.attach_host_tier(HostTierIndex(8))
    mem = Memory()
    compute(bm, mem, "a", prompt(1, 9))  # 3 blocks, 2 full ones hashed
    bm.free("a")
    assert len(bm._offloading) == 2 and len(bm._free) == 1
    assert bm.allocate("b", 4)  # the one plain free block
    assert not bm._wait_for_offloads
    assert bm.allocate("c", 4)  # only in-flight blocks are left: handed out, and the step must wait
    transfers = bm.drain_transfers()
    assert transfers.wait_for_offloads and len(transfers.offloads) == 2
    assert bm.drain_transfers().is_empty


def test_a_block_already_on_host_is_not_copied_again():
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.attach_host_tier(HostTierIndex(8))
    mem = Memory()
    compute(bm, mem, "a", prompt(1, 9))
    bm.free("a")
    assert len(bm.drain_transfers().offloads) == 2
    compute(bm, mem, "b", prompt(1, 9))  # device hit
    bm.free("b")
    assert bm.drain_transfers().is_empty


def test_pinned_slots_are_never_evicted_and_a_full_tier_declines():
    host = HostTierIndex(2)
    assert host.store(b"x", True) == 0 and host.store(b"y", True) == 1
    assert host.store(b"z", True) is None and host.counters.declined == 1  # both pinned by this step
    host.unpin_all()
    evicted = []
    host.on_evict = lambda slot, h, entry: evicted.append((slot, h))
    assert host.store(b"z", True) == 0 and evicted == [(0, b"x")]


def test_lora_blocks_are_keyed_by_adapter_and_not_persistent():
    bm = BlockManager(num_blocks=4, block_size=BS)
    host = HostTierIndex(8)
    bm.attach_host_tier(host)
    mem = Memory()
    compute(bm, mem, "a", prompt(1, 9), lora=3)
    bm.free("a")
    bm.drain_transfers()
    assert all(not e.persistent for e in host._entries.values())
    assert bm.find_cached_prefix(prompt(1, 9)).num_tokens == 0  # the base model never reads an adapter's KV


@pytest.mark.parametrize("beams", [1, 3])
def test_tables_of_one_admission_share_a_loaded_block(beams):
    bm = BlockManager(num_blocks=12, block_size=BS)
    bm.attach_host_tier(HostTierIndex(16))
    mem = Memory()
    compute(bm, mem, "a", prompt(1, 9))
    bm.free("a")
    mem.run(bm.drain_transfers())
    for k in range(2, 6):
        compute(bm, mem, f"r{k}", prompt(k, 9))
        bm.free(f"r{k}")
        mem.run(bm.drain_transfers())
    prefix = bm.find_cached_prefix(prompt(1, 9))
    assert prefix.num_host_tokens == 8
    for b in range(beams):
        assert bm.allocate(f"beam{b}", 9, prefix)
    transfers = bm.drain_transfers()
    assert len(transfers.loads) == 2  # loaded once, shared by every table
    assert len({tuple(bm.block_table(f"beam{b}"))[:2] for b in range(beams)}) == 1
