"""The tiers of the prefix cache below the device pool, as bookkeeping (plain Python, no torch).

A full, hashed KV block that its last user frees is offered to the host tier (`kv_offloading_size`): the block
manager hands the block id and a host slot to the next step (`KVTransfers.offloads`), whose worker copies it
to pinned host memory on a copy stream while the device goes on. When a later prompt's prefix runs past the
device pool's cached blocks into the host tier, the request gets fresh device blocks and the step copies the
slots back before it runs (`KVTransfers.loads`) instead of recomputing them. The host tier is LRU; what it
evicts may be written to the disk tier (`kv_offloading_dir`) by the engine (`on_evict`), and what the disk
tier holds is read back into host slots before a request needs it (`insert`, `from_disk`).

`HostTierIndex` is that tier's index: block hash -> slot. It never holds more entries than slots, and a slot
that the step being scheduled reads or writes is pinned until the step's transfers are drained, so no copy
ever reads a slot that another copy of the same step overwrites.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class KVTransfers:
    """The copies between the device pool and the host tier that one step makes before its forward (the
    worker's host tier does them; every tensor-parallel rank on its own shard)."""

    # (device block, host slot): device -> host on the copy stream, after the work queued before this step
    offloads: tuple[tuple[int, int], ...] = ()
    # (host slot, device block): host -> device, before the step reads the blocks
    loads: tuple[tuple[int, int], ...] = ()
    # A block of `offloads` is handed out again by this same step (the pool had nothing else free): the step
    # must wait for this step's offload copies before it writes (on the GPU: the compute stream waits on the copy
    # stream's event, the host never blocks).
    wait_for_offloads: bool = False

    @property
    def is_empty(self) -> bool:
        return not (self.offloads or self.loads)


NO_TRANSFERS = KVTransfers()


@dataclass
class HostEntry:
    """One block in the host tier."""

    slot: int
    persistent: bool  # may be written to the disk tier (False for a LoRA adapter's blocks: ids are per process)
    from_disk: bool = False  # read back from the disk tier and not yet used (its first hit counts as disk's)


@dataclass
class TierCounters:
    """A tier's counters since startup (blocks)."""

    stores: int = 0  # blocks copied into the tier
    hits: int = 0  # blocks a prompt found here and did not recompute
    evictions: int = 0  # blocks dropped to make room (written to the tier below, when there is one)
    declined: int = 0  # blocks not stored: every slot was pinned by the step being scheduled


# What the engine does with a block the host tier evicts: (slot, block hash, entry); called before the slot
# is reused, so the slot still holds the block (the disk tier copies it out).
EvictHook = Callable[[int, bytes, HostEntry], None]


class HostTierIndex:
    """`num_slots` host slots, LRU by last store or use."""

    def __init__(self, num_slots: int, on_evict: EvictHook | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.on_evict = on_evict
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # oldest first
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._pinned: set[int] = set()
        self.counters = TierCounters()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def get(self, block_hash: bytes) -> HostEntry | None:
        return self._entries.get(block_hash)

    def store(self, block_hash: bytes, persistent: bool) -> int | None:
        """A slot for a block being offloaded, pinned until the step's transfers are drained; None when the tier
        already holds it (made most recent) or every slot is pinned."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.move_to_end(block_hash)
            return None
        slot = self._take_slot()
        if slot is None:
            self.counters.declined += 1
            return None
        self._entries[block_hash] = HostEntry(slot, persistent)
        self._pinned.add(slot)
        self.counters.stores += 1
        return slot

    def insert(self, block_hash: bytes, persistent: bool = True) -> int | None:
        """A slot for a block read back from the disk tier (the caller fills it now); None when held already or
        every slot is pinned."""
        if block_hash in self._entries:
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self._entries[block_hash] = HostEntry(slot, persistent, from_disk=True)
        return slot

    def use(self, block_hash: bytes) -> HostEntry:
        """A prompt's prefix hit: the entry, made most recent and pinned until the transfers are drained."""
        entry = self._entries[block_hash]
        self._entries.move_to_end(block_hash)
        self._pinned.add(entry.slot)
        self.counters.hits += 1
        return entry

    def settled(self) -> list[tuple[bytes, HostEntry]]:
        """The blocks whose slots hold them now (not pinned by a step still being scheduled), oldest first."""
        return [(h, e) for h, e in self._entries.items() if e.slot not in self._pinned]

    def unpin_all(self) -> None:
        self._pinned.clear()

    def clear(self) -> None:
        """Forgets every block (`reset_prefix_cache`); the slots are free again."""
        self._entries.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, entry in self._entries.items():  # oldest first
            if entry.slot not in self._pinned:
                del self._entries[block_hash]
                self.counters.evictions += 1
                if self.on_evict is not None:
                    self.on_evict(entry.slot, block_hash, entry)
                return entry.slot
        return None
