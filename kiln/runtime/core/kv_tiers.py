"""The tiers of the prefix cache below the device pool, as bookkeeping (plain Python, no torch).

A full, hashed KV block that its last user frees is offered to the host tier (`kv_offloading_size`): the block
manager hands the block id and a host slot to the next step (`KVTransfers.offloads`), whose worker copies it
to pinned host memory on a copy stream while the device goes on. When a later prompt's prefix runs past the
device pool's cached blocks into the host tier, the request gets fresh device blocks and the step copies the
slots back before it runs (`KVTransfers.loads`) instead of recomputing them. The host tier is LRU; with a disk
tier (`kv_offloading_dir`) the engine writes its oldest blocks to disk ahead of their eviction, straight from
their slots (`write_candidates`, `writing`: such a slot is not reused until `finish_write`), and what the disk
tier holds is read back into reserved slots before a request needs it (`reserve`, `fill`, `from_disk`).

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
    on_disk: bool = False  # the disk tier holds it too: evicting it loses nothing
    writing: bool = False  # being written to the disk tier from its slot: the slot is not reused meanwhile


@dataclass
class TierCounters:
    """A tier's counters since startup (blocks)."""

    stores: int = 0  # blocks copied into the tier
    hits: int = 0  # blocks a prompt found here and did not recompute
    evictions: int = 0  # blocks dropped to make room (written to the tier below, when there is one)
    declined: int = 0  # blocks not stored: every slot was pinned by the step being scheduled


# What the engine does with a block the host tier evicts: (slot, block hash, entry); called before the slot
# is reused, so the slot still holds the block (the disk tier copies out one its writer has not reached).
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
        self._reserved: dict[bytes, int] = {}  # blocks being read from disk -> their slots
        self._draining: dict[bytes, int] = {}  # forgotten (clear) while written to disk -> their slots
        self.num_on_disk = 0  # entries the disk tier holds too
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

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot for a block being read back from the disk tier: held (never evicted, invisible to lookups)
        until `fill` or `release`; None when the tier holds or reserves it already, or every slot is pinned."""
        if block_hash in self._entries or block_hash in self._reserved:
            return None
        slot = self._take_slot()
        if slot is not None:
            self._reserved[block_hash] = slot
        return slot

    def fill(self, block_hash: bytes) -> None:
        """A reserved block's slot now holds it: a host-tier block like any other (its first hit is disk's)."""
        slot = self._reserved.pop(block_hash)
        self._entries[block_hash] = HostEntry(slot, persistent=True, from_disk=True, on_disk=True)
        self.num_on_disk += 1

    def release(self, block_hash: bytes) -> None:
        """A reserved block could not be read: its slot is free again."""
        self._free_slots.append(self._reserved.pop(block_hash))

    def use(self, block_hash: bytes) -> HostEntry:
        """A prompt's prefix hit: the entry, made most recent and pinned until the transfers are drained."""
        entry = self._entries[block_hash]
        self._entries.move_to_end(block_hash)
        self._pinned.add(entry.slot)
        self.counters.hits += 1
        return entry

    @property
    def num_free(self) -> int:
        """Slots holding nothing."""
        return len(self._free_slots)

    def write_candidates(self, n: int) -> list[tuple[bytes, HostEntry]]:
        """Up to `n` of the oldest blocks that the disk tier should take before they are evicted: persistent,
        not on disk or being written, not pinned by the step being scheduled (a scan of at most 4n entries)."""
        out: list[tuple[bytes, HostEntry]] = []
        for k, (block_hash, entry) in enumerate(self._entries.items()):
            if len(out) >= n or k >= 4 * n:
                break
            if entry.persistent and not entry.on_disk and not entry.writing and entry.slot not in self._pinned:
                out.append((block_hash, entry))
        return out

    def finish_write(self, block_hash: bytes, written: bool) -> None:
        """A block's write to the disk tier ended (`written`: its file is there): its slot may be reused."""
        entry = self._entries.get(block_hash)
        if entry is not None and entry.writing:
            entry.writing = False
            if written and not entry.on_disk:
                entry.on_disk = True
                self.num_on_disk += 1
        elif block_hash in self._draining:
            self._free_slots.append(self._draining.pop(block_hash))

    def settled(self) -> list[tuple[bytes, HostEntry]]:
        """The blocks whose slots hold them now (not pinned by a step still being scheduled), oldest first."""
        return [(h, e) for h, e in self._entries.items() if e.slot not in self._pinned]

    def unpin_all(self) -> None:
        self._pinned.clear()

    def clear(self) -> None:
        """Forgets every block (`reset_prefix_cache`); the slots are free again, but those being read into."""
        self._draining.update((h, e.slot) for h, e in self._entries.items() if e.writing)
        self._entries.clear()
        self.num_on_disk = 0
        busy = set(self._reserved.values()) | set(self._draining.values())
        self._free_slots = [s for s in range(self.num_slots - 1, -1, -1) if s not in busy]

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, entry in self._entries.items():  # oldest first
            if entry.slot not in self._pinned and not entry.writing:
                del self._entries[block_hash]
                self.num_on_disk -= entry.on_disk
                self.counters.evictions += 1
                if self.on_evict is not None:
                    self.on_evict(entry.slot, block_hash, entry)
                return entry.slot
        return None
