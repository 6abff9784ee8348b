"""The host tier of the KV cache: blocks copied out of the device pool into host memory and back.

The scheduler decides which blocks move (`KVTransfers`, runtime/core/kv_tiers.py); this object only holds the
host memory and makes the copies, once per step, before the step reads or writes the cache (`apply`). Every
tensor-parallel rank holds its own shard of each block in its own tier (same slot numbers on every rank).

On CUDA the offloads run on a copy stream of their own: it waits for the work queued before the step, gathers
the blocks into a device staging buffer and copies them into pinned host memory while the compute stream goes
on; the next step's compute waits on that copy (normally long done) before anything may write those blocks
again. Loads run on the compute stream (host -> staging -> the cache's blocks, in place: CUDA graphs read
those addresses). On the CPU every copy is a plain synchronous copy between two separate allocations.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from kiln.runtime.core.kv_tiers import KVTransfers
from kiln.runtime.worker.kv_cache import KVCache

logger = logging.getLogger("kiln.runtime")

GIB = 2**30
STAGING_BYTES = 64 * 2**20  # the most device memory each of the two staging buffers takes
OPTION = "kv_offloading_size (--kv-offloading-size)"


def host_tier_for(cache: KVCache, host_bytes: int) -> HostKVTier | None:
    """The tier `host_bytes` of host memory hold for `cache` (as many whole blocks as fit); None for 0. A
    ValueError names the option when that is less than one block."""
    if host_bytes <= 0:
        return None
    slot_bytes = slot_bytes_of(cache)
    if host_bytes < slot_bytes:
        raise ValueError(f"{OPTION} gives this rank {host_bytes} bytes of host memory, less than one KV block "
                         f"({slot_bytes} bytes: {cache.block_size} tokens over every layer's keys and values): "
                         f"raise it to at least {slot_bytes / GIB:.6f} GiB per rank, or 0 for no host tier")
    return HostKVTier(cache, host_bytes // slot_bytes)


def slot_bytes_of(cache: KVCache) -> int:
    """Bytes of one block over every layer's keys and values (one host slot)."""
    layers, kv, _, block_size, heads, dim = cache.storage.shape
    return layers * kv * block_size * heads * dim * cache.storage.element_size()


def _word_dtype(row_bytes: int) -> torch.dtype:
    """The widest integer type that tiles a row of `row_bytes`: the copies move words, not single bytes."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0:
            return dtype
    return torch.uint8


class HostKVTier:
    """`num_slots` blocks of host memory for `cache` (pinned on CUDA), one slot contiguous:
    [num_slots, layers, 2 (k, v), block_size, Hk, D] in the cache's dtype (`slots`).

    An FP8 / INT8 cache's scales are per-layer constants of the engine (engine.json `kv_cache_scales`), the same
    for every block, so a block's stored values are all that travels. `chunk_blocks`: the most blocks one
    staging copy moves (each of the two device staging buffers holds that many; default: what STAGING_BYTES
    holds). A ValueError names `kv_offloading_size` when the host memory cannot be had."""

    def __init__(self, cache: KVCache, num_slots: int, chunk_blocks: int | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one slot, got num_slots={num_slots}")
        storage = cache.storage  # [L, 2, num_blocks, block_size, Hk, D]
        layers, kv, num_blocks, block_size, heads, dim = storage.shape
        self.cache = cache
        self.device = storage.device
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes_of(cache)
        self.nbytes = num_slots * self.slot_bytes
        self._rows = layers * kv  # a block is one row of each (layer, k/v) plane
        row_bytes = self.slot_bytes // self._rows
        word = _word_dtype(row_bytes)
        # The cache as rows of words: [L * 2 * num_blocks, row words]; row (r * num_blocks + b) is block b of plane r.
        self._cache_rows = storage.view(self._rows * num_blocks, -1).view(word)
        self._num_blocks = num_blocks
        self._bytes = _host_buffer(num_slots, self.slot_bytes, pinned=self.device.type == "cuda")  # [S, bytes]
        if self.device.type == "cuda":
            weakref.finalize(self, _unregister, self._bytes.data_ptr())
        self._np = self._bytes.numpy()  # the same memory, for read_slot / write_slot
        self._host_rows = self._bytes.view(word).view(num_slots, self._rows, -1)  # [S, L * 2, row words]
        # [num_slots, layers, 2, block_size, Hk, D] in the cache's dtype
        self.slots = self._bytes.view(storage.dtype).view(num_slots, layers, kv, block_size, heads, dim)
        self.chunk_blocks = max(1, min(num_slots, chunk_blocks or STAGING_BYTES // self.slot_bytes))
        words = self._host_rows.shape[-1]
        # Offloads gather into one, loads land in the other (they run on different streams).
        self._stage_out = torch.empty(self.chunk_blocks, self._rows, words, dtype=word, device=self.device)
        self._stage_in = torch.empty(self.chunk_blocks, self._rows, words, dtype=word, device=self.device)
        # Plane r's row offset: block b of plane r is row b + offsets[r]
        self._row_offsets = torch.arange(self._rows, dtype=torch.int64, device=self.device) * num_blocks  # [L*2]
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._offload_done: torch.cuda.Event | None = None  # the last offloads' copy event
        self._offload_unwaited = False  # the compute stream has not waited on that event yet
        # Per slot, the event of the last copy that wrote or read it (CUDA): read_slot / write_slot wait for that
        # slot's own copy only, not for every copy in flight (the disk tier calls them between steps).
        self._slot_events: list[torch.cuda.Event | None] = [None] * num_slots
        self._timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # not yet read (CUDA)
        self._counts = {"offloaded_blocks": 0, "loaded_blocks": 0, "offloaded_bytes": 0, "loaded_bytes": 0}
        self._seconds = {"offload": 0.0, "load": 0.0}

    # ---- one step's copies ---------------------------------------------------------------------------
    def apply(self, transfers: KVTransfers) -> None:
        """The step's copies, called before anything of the step reads or writes the cache, every step (an empty
        `transfers` too: the step is ordered after the previous step's offloads, which read blocks it may write):
        the offloads (device -> host, asynchronous on CUDA), then the loads (host -> device, on the compute
        stream). A ValueError for a block or slot out of range."""
        self._check(transfers)
        if self._cuda:
            if len(self._timings) > 64:  # read now and then, not only when stats() is asked
                self._read_timings()
            compute = torch.cuda.current_stream(self.device)
            if self._offload_unwaited:  # the previous step's offloads read blocks this step may write
                compute.wait_event(self._offload_done)
                self._offload_unwaited = False
            if transfers.offloads:
                self._offload_cuda(transfers.offloads, compute)
                # A block just offloaded is handed out again by this step (or loaded into: checked here too).
                if transfers.wait_for_offloads or not {b for b, _ in transfers.offloads}.isdisjoint(
                        b for _, b in transfers.loads):
                    compute.wait_event(self._offload_done)
                else:
                    self._offload_unwaited = True
            if transfers.loads:
                self._load_cuda(transfers.loads, compute)
            return
        start = time.perf_counter()
        if transfers.offloads:
            for part in _chunks(transfers.offloads, self.chunk_blocks):
                self._gather(part, self._stage_out)
                self._to_slots(part, self._stage_out)
        mid = time.perf_counter()
        if transfers.loads:
            for part in _chunks(transfers.loads, self.chunk_blocks):
                self._from_slots(part, self._stage_in)
                self._scatter(part, self._stage_in)
        self._seconds["offload"] += mid - start
        self._seconds["load"] += time.perf_counter() - mid
        self._count(transfers)

    def _offload_cuda(self, offloads: Sequence[tuple[int, int]], compute: torch.cuda.Stream) -> None:
        stream = self._copy_stream
        queued = torch.cuda.Event()
        queued.record(compute)  # every write queued before this step, done before the gather
        stream.wait_event(queued)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):  # index tensors allocated here belong to the copy stream
            begin.record(stream)
            for part in _chunks(offloads, self.chunk_blocks):  # the staging buffer is reused in stream order
                self._gather(part, self._stage_out)
                self._to_slots(part, self._stage_out, non_blocking=True)
            end.record(stream)
        self._offload_done = end
        for _, slot in offloads:
            self._slot_events[slot] = end
        self._timings.append(("offload", begin, end))
        self._counts["offloaded_blocks"] += len(offloads)
        self._counts["offloaded_bytes"] += len(offloads) * self.slot_bytes

    def _load_cuda(self, loads: Sequence[tuple[int, int]], compute: torch.cuda.Stream) -> None:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(compute)
        for part in _chunks(loads, self.chunk_blocks):
            self._from_slots(part, self._stage_in, non_blocking=True)
            self._scatter(part, self._stage_in)
        end.record(compute)
        for slot, _ in loads:
            self._slot_events[slot] = end
        self._timings.append(("load", begin, end))
        self._counts["loaded_blocks"] += len(loads)
        self._counts["loaded_bytes"] += len(loads) * self.slot_bytes

    def _row_index(self, blocks: list[int]) -> torch.Tensor:
        """The cache rows of `blocks`, block-major: [len(blocks) * L * 2] (staging's order)."""
        ids = torch.tensor(blocks, dtype=torch.int64)  # [n]
        if self._cuda:  # pinned: the copy never waits for the stream (pageable memory may)
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        return (ids[:, None] + self._row_offsets[None, :]).reshape(-1)

    def _gather(self, part: Sequence[tuple[int, int]], stage: torch.Tensor) -> None:
        """Device blocks -> stage[:n] ([n, L * 2, row words])."""
        n = len(part)
        rows = stage[:n].view(n * self._rows, -1)  # contiguous: the first n slots of the buffer
        torch.index_select(self._cache_rows, 0, self._row_index([b for b, _ in part]), out=rows)

    def _scatter(self, part: Sequence[tuple[int, int]], stage: torch.Tensor) -> None:
        """stage[:n] -> device blocks, in place."""
        n = len(part)
        self._cache_rows.index_copy_(0, self._row_index([b for _, b in part]), stage[:n].view(n * self._rows, -1))

    def _to_slots(self, part: Sequence[tuple[int, int]], stage: torch.Tensor, non_blocking: bool = False) -> None:
        for i, slot, count in _runs([s for _, s in part]):
            self._host_rows[slot:slot + count].copy_(stage[i:i + count], non_blocking=non_blocking)

    def _from_slots(self, part: Sequence[tuple[int, int]], stage: torch.Tensor, non_blocking: bool = False) -> None:
        for i, slot, count in _runs([s for s, _ in part]):
            stage[i:i + count].copy_(self._host_rows[slot:slot + count], non_blocking=non_blocking)

    def _check(self, transfers: KVTransfers) -> None:
        for what, pairs, block_at in (("offloads", transfers.offloads, 0), ("loads", transfers.loads, 1)):
            if not pairs:
                continue
            blocks = [p[block_at] for p in pairs]
            slots = [p[1 - block_at] for p in pairs]
            if min(blocks) < 0 or max(blocks) >= self._num_blocks:
                raise ValueError(f"KV transfers: {what} name a device block outside [0, {self._num_blocks})")
            if min(slots) < 0 or max(slots) >= self.num_slots:
                raise ValueError(f"KV transfers: {what} name a host slot outside [0, {self.num_slots})")

    def _count(self, transfers: KVTransfers) -> None:
        self._counts["offloaded_blocks"] += len(transfers.offloads)
        self._counts["offloaded_bytes"] += len(transfers.offloads) * self.slot_bytes
        self._counts["loaded_blocks"] += len(transfers.loads)
        self._counts["loaded_bytes"] += len(transfers.loads) * self.slot_bytes

    # ---- the disk tier's access to slots -------------------------------------------------------------
    def read_slot(self, slot: int) -> memoryview:
        """The bytes of the block in `slot` (`slot_bytes` of them), once every queued offload has landed. A view
        of the tier's memory: valid until the slot is written again (copy it to keep it)."""
        self._check_slot(slot)
        self._settle(slot)
        return memoryview(self._np[slot])

    def slot_buffer(self, slot: int) -> memoryview:
        """`slot`'s memory, writable (the disk tier reads a block file straight into it), once the queued copy
        that last touched the slot is done; the caller keeps every copy away from it meanwhile."""
        self._check_slot(slot)
        self._settle(slot)
        return memoryview(self._np[slot])

    def write_slot(self, slot: int, payload: bytes | bytearray | memoryview) -> None:
        """Fills `slot` with a block's bytes (exactly `slot_bytes`), once the queued copies that read or write
        slots are done."""
        self._check_slot(slot)
        data = np.frombuffer(payload, dtype=np.uint8)
        if data.size != self.slot_bytes:
            raise ValueError(f"a host KV slot holds {self.slot_bytes} bytes, got a payload of {data.size}")
        self._settle(slot)
        self._np[slot] = data

    def _settle(self, slot: int) -> None:
        """Waits for the queued copy that last wrote or read `slot`, if it has not completed."""
        event = self._slot_events[slot]
        if event is not None:
            if not event.query():
                event.synchronize()
            self._slot_events[slot] = None

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"host KV slot {slot} is outside [0, {self.num_slots})")

    # ---- counters --------------------------------------------------------------------------------------
    def _read_timings(self) -> None:
        """Adds the elapsed time of the completed copies (CUDA) to the seconds; the others stay pending."""
        pending = []
        for kind, begin, end in self._timings:
            if end.query():
                self._seconds[kind] += begin.elapsed_time(end) / 1000.0
            else:
                pending.append((kind, begin, end))
        self._timings = pending

    def stats(self) -> dict[str, int | float]:
        """Blocks and bytes copied each way since startup, and the seconds the copies took (on CUDA: the
        elapsed time of the copies that have completed; on the CPU: their wall time)."""
        self._read_timings()
        return {**self._counts, "offload_seconds": self._seconds["offload"], "load_seconds": self._seconds["load"],
                "num_slots": self.num_slots, "nbytes": self.nbytes}


def _chunks(pairs: Sequence[tuple[int, int]], size: int) -> list[Sequence[tuple[int, int]]]:
    return [pairs[i:i + size] for i in range(0, len(pairs), size)]


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(staging position, first slot, count) of each run of consecutive slots: one copy per run."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((i, slot, 1))
    return runs


def _host_buffer(num_slots: int, slot_bytes: int, pinned: bool) -> torch.Tensor:
    """[num_slots, slot_bytes] uint8 host memory; `pinned`: page-locked for asynchronous copies. Pinned by
    registering a plain allocation: torch's pinned allocator would round a large size up to a power of two."""
    nbytes = num_slots * slot_bytes
    _check_host_memory(nbytes)
    kind = "pinned host memory" if pinned else "host memory"
    try:
        buffer = torch.empty(num_slots, slot_bytes, dtype=torch.uint8)
        if pinned:
            start = time.perf_counter()
            # Touch every page first with torch's threads: the first-touch faults are most of what pinning a
            # large buffer costs, and one thread (inside cudaHostRegister) takes them one after another.
            buffer.fill_(0)
            # 1: cudaHostRegisterPortable, pinned for every device's context, not only the current device's
            error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 1))
            if error != 0:
                raise RuntimeError(f"cudaHostRegister failed with CUDA error {error}")
            logger.info("host KV tier: %.1f GiB of host memory pinned in %.1fs", nbytes / GIB,
                        time.perf_counter() - start)
    except RuntimeError as e:  # the host's out of memory, or the driver's refusal to lock that much
        raise ValueError(f"{OPTION}: cannot allocate {nbytes / GIB:.2f} GiB of {kind} for {num_slots} KV blocks "
                         f"({e}); lower it") from None
    return buffer


def _unregister(pointer: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(pointer)


def _check_host_memory(nbytes: int) -> None:
    """More than the host has is refused before allocating (an allocation that large would only fail later,
    or bring in the OOM killer)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not every system tells
        return
    if nbytes >= total:
        raise ValueError(f"{OPTION} asks for {nbytes / GIB:.2f} GiB of host memory on this rank, but this host has "
                         f"{total / GIB:.2f} GiB in all: lower it")
