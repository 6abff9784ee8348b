"""The prefix cache's host and disk tiers, as the engine runs them (issue: a tiered KV cache).

The block manager offers freed hashed blocks to the host tier's index and finds prefixes there
(core/kv_tiers.py); each step's worker copies the blocks (worker/kv_host_tier.py). This stage adds what lives
beside the step: the disk tier (worker/kv_disk_tier.py), which takes the blocks the host tier evicts and, when
a new request's prefix continues on disk past what the device and host hold, reads those files on a reader
thread into host slots while the request waits (`Request.kv_pending`; others start meanwhile), so the step that
starts it loads them like any host hit. A file that fails its checks is skipped and its blocks recomputed.

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
        blocks.attach_host_tier(self.host)
        self.disk: DiskKVTier | None = None
        self._reads: queue.Queue[tuple[Request, list[bytes]] | None] = queue.Queue()
        self._done: queue.Queue[tuple[Request, list[tuple[bytes, bytes]]]] = queue.Queue()
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
        """A request just added: if its prefix continues on disk past what the device and host hold, reads
        those blocks on the reader thread while the request waits (`kv_pending`)."""
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
        if on_disk:
            request.kv_pending = True
            self._pending += 1
            self._reads.put((request, on_disk))

    def poll(self, idle: Callable[[], bool]) -> None:
        """Before each schedule: blocks read from disk go into host slots and their requests may start. When
        `idle()` (nothing else to run), waits a little for a read rather than spinning."""
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
            for block_hash, payload in blocks:
                if self.blocks.is_cached(block_hash):
                    continue
                slot = self.host.insert(block_hash)
                if slot is None:  # every slot pinned: the rest is recomputed
                    break
                self.host_memory.write_slot(slot, payload)
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
            if entry.persistent and block_hash not in self.disk:
                if self.disk.stats()["pending"] >= self.disk.max_pending_writes:
                    self.disk.flush()  # a full queue would drop it
                self.disk.write(block_hash, self.host_memory.read_slot(entry.slot))
        self.disk.close()

    # ---- internals -------------------------------------------------------------------------------
    def _demote(self, slot: int, block_hash: bytes, entry: HostEntry) -> None:
        """The host tier evicts a block: the disk tier keeps it (not a LoRA adapter's: ids are per process)."""
        if self.disk is not None and entry.persistent and block_hash not in self.disk:
            self.disk.write(block_hash, self.host_memory.read_slot(slot))

    def _read_loop(self) -> None:
        # A request's files are read and checked by several threads at once (reading and hashing release the
        # GIL): one thread reads about 0.3 GB/s, most of it the checksum.
        with ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="kiln-kv-disk-read") as pool:
            while (job := self._reads.get()) is not None:
                request, hashes = job
                blocks: list[tuple[bytes, bytes]] = []
                for block_hash, payload in zip(hashes, pool.map(self.disk.read, hashes)):
                    if payload is None:  # missing or failed its checks: recomputed from here
                        break
                    blocks.append((block_hash, payload))
                self._done.put((request, blocks))
