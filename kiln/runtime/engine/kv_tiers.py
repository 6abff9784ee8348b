"""The prefix cache's host and disk tiers, as the engine runs them (issue: a tiered KV cache).

The block manager offers freed hashed blocks to the host tier's index and finds prefixes there
(core/kv_tiers.py); each step's worker copies the blocks (worker/kv_host_tier.py). This stage adds what lives
beside the step: the disk tier (worker/kv_disk_tier.py). Before each schedule it hands the host tier's oldest
blocks to the disk tier's writer thread, which writes them straight from their slots (kept from reuse until
written), so that the host tier always has free or already-written slots to evict and the engine's thread never
copies a block. When a new request's prefix continues on disk past what the device and host hold, reader
threads read those files straight into reserved host slots while the request waits (`Request.kv_pending`; others
start meanwhile), and the step that starts it loads them like any host hit. A file that fails its checks is
skipped and its blocks recomputed.

The disk tier runs in the process that holds the host tier's memory: tensor parallelism keeps to the host tier.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.kv_tiers import HostEntry, HostTierIndex
from kiln.runtime.core.request import Request
from kiln.runtime.worker.engine_loader import EngineInfo, RuntimeConfig
from kiln.runtime.worker.kv_disk_tier import DiskKVTier, kv_identity

logger = logging.getLogger("kiln.runtime")

GIB = 1 << 30
READ_THREADS = min(8, os.cpu_count() or 1)


def kv_tiers(blocks: BlockManager, executor, info: EngineInfo, runtime: RuntimeConfig) -> KVTiers | NoTiers:
    """The engine's tiers: `KVTiers` when the executor holds host slots (`kv_offloading_size`), else a stand-in
    whose hooks do nothing."""
    if getattr(executor, "num_host_kv_blocks", 0) > 0:
        if not runtime.enable_prefix_caching:
            logger.warning("kv_offloading_size (--kv-offloading-size) is set but prefix caching is off: the host "
                           "and disk tiers hold only cached prefix blocks, so they stay empty")
        return KVTiers(blocks, executor, info, runtime)
    return NoTiers()


class NoTiers:
    """No tiers below the device pool (`kv_offloading_size` 0)."""

    def probe(self, request: Request) -> None:
        pass

    def poll(self, idle: Callable[[], bool]) -> None:
        pass

    def stats(self) -> dict[str, int | float]:
        return {}

    def close(self) -> None:
        pass


class KVTiers:
    """The host tier's index (attached to `blocks`) and the disk tier, if any. `executor`: the engine's
    (`num_host_kv_blocks`, and `host_kv_tier` for the disk tier)."""

    def __init__(self, blocks: BlockManager, executor, info: EngineInfo, runtime: RuntimeConfig) -> None:
        self.blocks = blocks
        self.host_memory = getattr(executor, "host_kv_tier", None)  # rank 0's slots, in this process
        self.host = HostTierIndex(executor.num_host_kv_blocks, on_evict=self._demote)
        # The disk tier writes ahead while fewer slots than this are free or hold blocks already on disk.
        self._low_water = max(4, self.host.num_slots // 8)
        blocks.attach_host_tier(self.host)
        self.disk: DiskKVTier | None = None
        # (request, [(block hash, its reserved slot's memory)]) to read; (request, [(block hash, read?)]) read
        self._reads: queue.Queue[tuple[Request, list[tuple[bytes, memoryview]]] | None] = queue.Queue()
        self._done: queue.Queue[tuple[Request, list[tuple[bytes, bool]]]] = queue.Queue()
        self._pending = 0  # reads submitted and not yet taken back by poll
        directory = runtime.kv_offloading_dir
        if directory is not None:
            self.disk = self._open_disk(Path(directory), info, runtime)
            self._reader = threading.Thread(target=self._read_loop, name="kiln-kv-disk-reader", daemon=True)
            self._reader.start()
        logger.info("%s", self.describe(runtime))

    def _open_disk(self, directory: Path, info: EngineInfo, runtime: RuntimeConfig) -> DiskKVTier:
        if self.host_memory is None:
            raise ValueError("kv_offloading_dir (--kv-offloading-dir): the disk tier needs the host tier in the "
                             "engine's own process; a tensor-parallel engine (tp_size > 1) keeps to the host "
                             "tier (--kv-offloading-size) for now")
        mapping = info.config.mapping
        identity = kv_identity(info.spec, kv_cache_dtype=str(runtime.cache_dtype).removeprefix("torch."),
                               block_size=runtime.block_size, tp_size=mapping.tp_size, tp_rank=mapping.tp_rank,
                               block_bytes=self.host_memory.slot_bytes)
        return DiskKVTier(directory, int(runtime.kv_offloading_disk_size * GIB), identity,
                          self.host_memory.slot_bytes)

    def describe(self, runtime: RuntimeConfig) -> str:
        """The tiers' sizes, for the startup memory plan."""
        text = f"KV offloading: host tier {runtime.kv_offloading_size:g} GiB ({self.host.num_slots} blocks)"
        if self.disk is not None:
            text += (f", disk tier {runtime.kv_offloading_dir} up to {runtime.kv_offloading_disk_size:g} GiB "
                     f"({len(self.disk)} blocks found from earlier runs)")
        return text

    # ---- engine hooks ----------------------------------------------------------------------------
    def probe(self, request: Request) -> None:
        """A request just added: if its prefix continues on disk past what the device and host hold, reserves
        host slots for those blocks and has the reader threads read the files straight into them while the
        request waits (`kv_pending`)."""
        if self.disk is None or request.sampling_params.needs_prompt_positions or request.beams is not None:
            return
        on_disk: list[bytes] = []
        for block_hash in self.blocks.prefix_hashes(request.prompt_token_ids, request.lora_int_id):
            if self.blocks.is_cached(block_hash):
                if on_disk:
                    break
                continue
            if block_hash not in self.disk:
                break
            on_disk.append(block_hash)
        job = []
        for block_hash in on_disk:
            slot = self.host.reserve(block_hash)
            if slot is None:  # every slot pinned: the rest is recomputed
                break
            job.append((block_hash, self.host_memory.slot_buffer(slot)))
        if job:
            request.kv_pending = True
            self._pending += 1
            self._reads.put((request, job))

    def poll(self, idle: Callable[[], bool]) -> None:
        """Before each schedule: the host tier's oldest blocks go to the disk tier's writer, blocks read from
        disk go into host slots and their requests may start. When `idle()` (nothing else to run), waits a
        little for a read rather than spinning."""
        if self.disk is None:
            return
        self._write_ahead()
        if not self._pending:
            return
        wait = 0.005 if idle() else 0.0
        while self._pending:
            try:
                request, blocks = self._done.get(timeout=wait) if wait else self._done.get_nowait()
            except queue.Empty:
                return
            wait = 0.0
            self._pending -= 1
            chain = True  # a block after one that failed is of no use: the prefix breaks there
            for block_hash, ok in blocks:
                chain = chain and ok
                if chain and not self.blocks.is_cached(block_hash):  # (computed meanwhile: not needed)
                    self.host.fill(block_hash)
                else:
                    self.host.release(block_hash)
            request.kv_pending = False

    def stats(self) -> dict[str, int | float]:
        """The tiers' counters for `kv_cache_stats` (blocks unless named otherwise)."""
        c = self.host.counters
        out: dict[str, int | float] = {
            "host_tier_slots": self.host.num_slots, "host_tier_blocks": len(self.host),
            "host_tier_stores": c.stores, "host_tier_hits": c.hits, "host_tier_evictions": c.evictions,
            "host_tier_declined": c.declined}
        if self.host_memory is not None:
            out.update({f"host_tier_{k}": v for k, v in self.host_memory.stats().items()})
        if self.disk is not None:
            out.update({f"disk_tier_{k}": v for k, v in self.disk.stats().items()})
        return out

    def close(self) -> None:
        """Stops the reader and writes what the host tier holds to the disk tier (up to its limit, so the
        newest blocks are the ones kept), so that a restart finds it; waits for the writes."""
        if self.disk is None:
            return
        self._reads.put(None)
        self._reader.join(timeout=5)
        for block_hash, entry in self.host.settled():  # oldest first: the disk's LRU evicts those first
            if entry.persistent and not entry.on_disk and not entry.writing and block_hash not in self.disk:
                if self.disk.stats()["pending"] >= self.disk.max_pending_writes:
                    self.disk.flush()  # a full queue would drop it
                self.disk.write_view(block_hash, self.host_memory.read_slot(entry.slot))  # nothing reuses it now
        self.disk.close()

    # ---- internals -------------------------------------------------------------------------------
    def _demote(self, slot: int, block_hash: bytes, entry: HostEntry) -> None:
        """The host tier evicts a block the writer has not reached (it fell behind): copied out now, on this
        thread, so that the disk tier still gets it (not a LoRA adapter's: ids are per process)."""
        if self.disk is not None and entry.persistent and not entry.on_disk and block_hash not in self.disk:
            self.disk.write(block_hash, self.host_memory.read_slot(slot))

    def _write_ahead(self) -> None:
        """Ends the disk writes that finished, then queues the oldest blocks not on disk while too few slots are
        free or evictable at no loss (not a LoRA adapter's blocks: adapter ids are per process)."""
        for block_hash, written in self.disk.take_finished():
            self.host.finish_write(block_hash, written)
        short = self._low_water - self.host.num_free - self.host.num_on_disk
        if short <= 0:
            return
        room = self.disk.max_pending_writes - int(self.disk.stats()["pending"])
        for block_hash, entry in self.host.write_candidates(min(short, room)):
            entry.writing = True
            if not self.disk.write_view(block_hash, self.host_memory.read_slot(entry.slot)):
                self.host.finish_write(block_hash, block_hash in self.disk)  # on disk already, or dropped

    def _read_loop(self) -> None:
        # A request's files are read and checked by several threads at once (reading and hashing release the
        # GIL): one thread reads about 0.3 GB/s, most of it the checksum.
        with ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="kiln-kv-disk-read") as pool:
            while (job := self._reads.get()) is not None:
                request, blocks = job
                read = pool.map(lambda item: self.disk.read_into(*item), blocks)
                self._done.put((request, [(block_hash, ok) for (block_hash, _), ok in zip(blocks, read)]))
