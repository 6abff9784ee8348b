"""Paged KV-cache bookkeeping with prefix caching (plain Python, no torch).

The cache is `num_blocks` blocks of `block_size` token slots. A request owns an ordered list of blocks
(its block table). A block that a request has completely filled and computed is registered under a hash
of its tokens and of every token before it; a later request whose prompt starts with the same tokens
reuses it instead of recomputing. When a request ends, its blocks return to a free queue but keep their
contents and hash until the block is handed out again (least recently freed first), so cached prefixes
survive as long as memory allows.

Verbs the scheduler uses: `find_cached_prefix`, `allocate`, `cache_full_blocks`, `trim`, `free`,
`drain_transfers`. A table is handed out as a `BlockTable` (block_table.py): each list of blocks kept here is
only ever appended to, so a snapshot is a reference and a length, not a copy, and says by its stamp whether it
continues an earlier one.

With a host tier (`attach_host_tier`, kv_tiers.py) a freed hashed block is also offered to host memory: the
next step copies it there while the block waits one step outside the free queue (in flight; still counted
free, and handed out only when nothing else is, with the step told to wait for the copy), and a prefix that
continues past the device's cached blocks into the host tier gets fresh blocks that the step loads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.runtime.core.block_hashes import chain_hash, first_parent
from kiln.runtime.core.block_table import BlockTable, new_stamp
from kiln.runtime.core.kv_tiers import NO_TRANSFERS, HostTierIndex, KVTransfers


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    persistent: bool = True  # its KV may outlive the process (disk tier): False for a LoRA adapter's blocks


class _Blocks(dict[int, _Block]):
    """Block id -> its `_Block`, made on first use: a list of every block took seconds to build for the
    millions of blocks a small model has on a big GPU. Reading an id never used gives a fresh block."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self.num_blocks = num_blocks

    def __missing__(self, block_id: int) -> _Block:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} is outside the pool's {self.num_blocks} blocks")
        block = self[block_id] = _Block(block_id)
        return block


@dataclass(frozen=True)
class CachedPrefix:
    """Blocks of the prefix cache that a prompt can start from (empty when nothing matched): `block_ids` in the
    device pool, then `host_hashes`, the blocks after the first one the device lacks, which the host tier holds
    (loaded into fresh blocks by the step) or the device again. `num_tokens` counts all; `num_host_tokens` /
    `num_disk_tokens` the host tier's share (the latter: blocks read back from the disk tier)."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    host_hashes: tuple[bytes, ...] = ()
    num_host_tokens: int = 0
    num_disk_tokens: int = 0

    @property
    def num_device_tokens(self) -> int:
        return self.num_tokens - self.num_host_tokens


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = _Blocks(num_blocks)
        # The free queue, handed out from its front, is three parts so that it starts in O(1): `_trimmed` (blocks
        # given back by trim, newest first), then the ids never used yet (`_next_unused` on, in id order), then
        # `_free` (the other blocks nobody uses, oldest-freed first). The dicts keep order and remove in O(1).
        self._trimmed: OrderedDict[int, None] = OrderedDict()
        self._next_unused = 0
        self._free: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        # request id -> its blocks. Append-only: a table that loses blocks gets a new list (and stamp), so the
        # BlockTables handed out stay valid snapshots.
        self._tables: dict[str, list[int]] = {}
        self._stamps: dict[str, int] = {}  # request id -> the stamp of its current list
        self._hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its first full blocks
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        # The host tier (None: off). Freed hashed blocks whose copy to it the next step makes wait here, in the
        # order they were freed, instead of in _free; drain_transfers moves them to _free's end.
        self.host: HostTierIndex | None = None
        self._offloading: OrderedDict[int, None] = OrderedDict()
        self._offloads: list[tuple[int, int]] = []  # (block, slot) for the next step
        self._offload_slots: set[int] = set()  # their slots
        self._loads: list[tuple[int, int]] = []  # (slot, block) for the next step
        self._wait_for_offloads = False

    def attach_host_tier(self, host: HostTierIndex) -> None:
        """Offers freed hashed blocks to `host` and finds prefixes there (before any request is added)."""
        self.host = host

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that could be allocated now, cached-but-unused ones and those being copied to the host tier
        included."""
        return len(self._trimmed) + self.num_blocks - self._next_unused + len(self._free) + len(self._offloading)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def block_table(self, request_id: str) -> BlockTable:
        """A snapshot of the request's blocks, in order: O(1), it shares the live list, which only grows at
        its end while the snapshot reads its first entries (empty for a request without blocks)."""
        table = self._tables.get(request_id)
        if table is None:
            return BlockTable([])
        return BlockTable(table, len(table), self._stamps[request_id])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- verbs ---------------------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int], lora_int_id: int = 0, salt: bytes = b"") -> CachedPrefix:
        """Longest run of cached full blocks that `token_ids` starts with, computed with LoRA adapter
        `lora_int_id` (0: the base model) and `salt` (block_hashes.py). It never covers the last token, whose
        logits the request still has to compute."""
        if not self.enable_prefix_caching:
            return CachedPrefix()
        max_blocks = (len(token_ids) - 1) // self.block_size
        found: list[int] = []
        rest: list[bytes] = []  # the prefix's blocks after the first one the device pool lacks, by hash
        num_host = num_disk = 0
        parent = first_parent(lora_int_id, salt)
        for i in range(max_blocks):
            parent = chain_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self._cached.get(parent)
            if block_id is not None and not rest:
                found.append(block_id)
                continue
            entry = self.host.get(parent) if self.host is not None and block_id is None else None
            if entry is None and block_id is None:
                break
            rest.append(parent)
            if entry is not None:
                num_host += 1
                num_disk += entry.from_disk
        bs = self.block_size
        return CachedPrefix(tuple(found), (len(found) + len(rest)) * bs, tuple(rest), num_host * bs, num_disk * bs)

    def prefix_hashes(self, token_ids: Sequence[int], lora_int_id: int = 0) -> list[bytes]:
        """The chain hashes of every full block of `token_ids` that a prompt could start from (the disk tier
        looks these up before the request is scheduled)."""
        parent = first_parent(lora_int_id)
        hashes = []
        for i in range((len(token_ids) - 1) // self.block_size):
            parent = chain_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def is_cached(self, block_hash: bytes) -> bool:
        """Whether the device pool or the host tier holds the block."""
        return block_hash in self._cached or (self.host is not None and block_hash in self.host)

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_query_tokens += num_prompt_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def can_allocate(self, request_id: str, num_tokens: int, prefix: CachedPrefix = CachedPrefix()) -> bool:
        table = self._tables.get(request_id, [])
        have = len(table) + len(prefix.block_ids)
        new = max(0, self.blocks_needed(num_tokens) - have)
        # Cached blocks taken from the free queue count against what is free.
        reclaimed = sum(1 for b in prefix.block_ids if self._blocks[b].ref_count == 0)
        return new + reclaimed <= self.num_free_blocks

    def allocate(self, request_id: str, num_tokens: int, prefix: CachedPrefix = CachedPrefix()) -> bool:
        """Makes the request own enough blocks for `num_tokens` tokens in total, starting its table with
        `prefix` (only on its first allocation). Returns False and changes nothing if memory is short."""
        table = self._tables.get(request_id)
        if table is not None:
            if prefix.block_ids or prefix.host_hashes:
                raise ValueError(f"request {request_id} already has blocks; "
                                 "a cached prefix only starts a table")
            if len(table) * self.block_size >= num_tokens:  # the usual case: a decode within its last block
                return True
        if not self.can_allocate(request_id, num_tokens, prefix):
            return False
        if table is None:
            table = self._tables[request_id] = []
            self._stamps[request_id] = new_stamp()
        for block_id in prefix.block_ids:
            self._take(block_id)
            table.append(block_id)
        if prefix.block_ids or prefix.host_hashes:
            self._hashes[request_id] = [self._blocks[b].block_hash for b in prefix.block_ids]  # type: ignore[misc]
            self._hashes[request_id] += prefix.host_hashes
        for block_hash in prefix.host_hashes:
            table.append(self._load(block_hash))
        while len(table) < self.blocks_needed(num_tokens):
            table.append(self._fresh_block())
        return True

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          lora_int_id: int = 0, salt: bytes = b"") -> None:
        """Registers the request's blocks that `num_computed_tokens` has completely filled. `token_ids` are
        the request's accepted tokens; a computed position past them (a draft) is never hashed.
        `lora_int_id`: the adapter the request runs with (0: the base model), part of every block's hash, as
        `salt` is."""
        if not self.enable_prefix_caching:
            return
        num_computed_tokens = min(num_computed_tokens, len(token_ids))
        table = self._tables.get(request_id, [])
        hashes = self._hashes.setdefault(request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(table))
        parent = hashes[-1] if hashes else first_parent(lora_int_id, salt)
        for i in range(len(hashes), num_full):
            parent = chain_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(parent)
            block = self._blocks[table[i]]
            if block.block_hash is None and parent not in self._cached:
                block.block_hash = parent
                block.persistent = not lora_int_id
                self._cached[parent] = block.block_id

    def free(self, request_id: str) -> None:
        """Releases the request's blocks, last block first: the free queue hands out its oldest entries
        first, so a request's private tail is reused before the shared prefix it started from."""
        table = self._tables.pop(request_id, [])  # the list itself is left as it is: snapshots may read it
        self._stamps.pop(request_id, None)
        self._hashes.pop(request_id, None)
        for block_id in reversed(table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._release(block)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Gives back the request's blocks past the first `num_tokens` tokens (slots of rejected drafts).
        They hold no accepted token, so no hash: they go to the front of the free queue, to be reused before
        any block that still caches a prefix."""
        table = self._tables.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if table is None or len(table) <= keep:
            return
        # A new list rather than popping: snapshots of the old one stay what they were.
        self._tables[request_id] = table[:keep]
        self._stamps[request_id] = new_stamp()
        for block_id in reversed(table[keep:]):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._trimmed[block.block_id] = None
                self._trimmed.move_to_end(block.block_id, last=False)

    # ---- beams: shared tables, copy-on-write (beam_search.py) -------------------------------------
    def fork(self, src_id: str, dst_id: str) -> None:
        """Makes `dst_id` a table sharing every block of `src_id` (each block's reference count goes up), in a
        list and stamp of its own; a block both will write is copied first (`copy_on_write`)."""
        table = self._tables[src_id]
        for block_id in table:
            self._blocks[block_id].ref_count += 1
        self._tables[dst_id] = list(table)
        self._stamps[dst_id] = new_stamp()
        self._hashes[dst_id] = list(self._hashes.get(src_id, ()))

    def rename(self, src_id: str, dst_id: str) -> None:
        """Hands `src_id`'s table (list, stamp and hashes) to `dst_id`: nothing is copied."""
        self._tables[dst_id] = self._tables.pop(src_id)
        self._stamps[dst_id] = self._stamps.pop(src_id)
        if src_id in self._hashes:
            self._hashes[dst_id] = self._hashes.pop(src_id)

    def copy_on_write(self, request_id: str, position: int) -> tuple[int, int] | None | bool:
        """Before the table writes token slot `position`: if its block is shared with another table, the table
        takes a free block instead (a new list and stamp) and the (src, dst) copy the device must make first is
        returned; None when the block is its own (or not allocated yet); False, changing nothing, when no block
        is free."""
        table = self._tables.get(request_id)
        index = position // self.block_size
        if table is None or index >= len(table) or self._blocks[table[index]].ref_count == 1:
            return None
        if not self.num_free_blocks:
            return False
        src = table[index]
        dst = self._fresh_block()
        self._blocks[src].ref_count -= 1  # still >= 1: another table holds it
        table = self._tables[request_id] = list(table)
        table[index] = dst
        self._stamps[request_id] = new_stamp()
        return src, dst

    def reset_prefix_cache(self, device_only: bool = False) -> None:
        """Forgets every cached block that no request uses, the host tier's too unless `device_only` (a prefix
        the host tier holds is then loaded from there)."""
        for block_id in [*self._trimmed, *self._free, *self._offloading]:
            self._evict(block_id)
        if self.host is not None and not device_only:
            self.host.clear()

    def drain_transfers(self) -> KVTransfers:
        """The host-tier copies the step being scheduled makes (once per step, after its allocations): the
        blocks whose copy it makes stop being in flight from the next step on (they join the free queue's end,
        as freed blocks do), and the host tier's slots are no longer pinned."""
        if self.host is None:
            return NO_TRANSFERS
        transfers = KVTransfers(tuple(self._offloads), tuple(self._loads), self._wait_for_offloads) \
            if self._offloads or self._loads else NO_TRANSFERS
        self._offloads, self._loads, self._wait_for_offloads = [], [], False
        self._offload_slots.clear()
        self._free.update(self._offloading)
        self._offloading.clear()
        self.host.unpin_all()
        return transfers

    # ---- internals -----------------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:  # a block once used (never-used ones are taken by _fresh_block alone)
            if self._free.pop(block_id, False) is False and self._trimmed.pop(block_id, False) is False:
                del self._offloading[block_id]  # read while its copy is in flight: both only read it
        block.ref_count += 1

    def _fresh_block(self) -> int:
        """Takes the free queue's first block (its cached hash forgotten): a trimmed one, a never-used one, the
        least recently freed one. One whose copy to the host tier is in flight only when nothing else is free:
        the step then waits for that copy before it writes."""
        if self._trimmed:
            block_id = next(iter(self._trimmed))
        elif self._next_unused < self.num_blocks:  # no hash to forget, in no queue
            block_id = self._next_unused
            self._next_unused += 1
            self._blocks[block_id].ref_count += 1
            return block_id
        elif self._free:
            block_id = next(iter(self._free))
        else:
            block_id = next(iter(self._offloading))
            self._wait_for_offloads = True
        self._evict(block_id)
        self._take(block_id)
        return block_id

    def _load(self, block_hash: bytes) -> int:
        """A device block for a prefix block the host tier holds: a fresh one the step loads the slot into
        (cached under its hash at once), or the one an earlier table of the same admission loaded."""
        block_id = self._cached.get(block_hash)
        if block_id is not None:
            self._take(block_id)
            return block_id
        entry = self.host.use(block_hash)  # type: ignore[union-attr]
        entry.from_disk = False
        if entry.slot in self._offload_slots:  # its copy to the host is this step's too
            self._wait_for_offloads = True
        block_id = self._fresh_block()
        block = self._blocks[block_id]
        block.block_hash, block.persistent = block_hash, entry.persistent
        self._cached[block_hash] = block_id
        self._loads.append((entry.slot, block_id))
        return block_id

    def _release(self, block: _Block) -> None:
        """A block nobody uses any more: to the free queue, or first to the host tier when it caches a prefix
        the tier does not hold yet."""
        if self.host is not None and block.block_hash is not None:
            slot = self.host.store(block.block_hash, block.persistent)
            if slot is not None:
                self._offloads.append((block.block_id, slot))
                self._offload_slots.add(slot)
                self._offloading[block.block_id] = None
                return
        self._free[block.block_id] = None

    def _evict(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
