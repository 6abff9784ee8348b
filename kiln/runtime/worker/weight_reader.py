"""Reading one rank's safetensors weight file onto a GPU in large reads by a few threads.

safetensors' `load_file(..., device="cuda")` maps the file and copies tensor by tensor: on a fresh machine each
tensor's pages fault in from disk in small read-ahead steps, and each copy from mapped (pageable) memory waits
for the driver to stage it. Here the file's data is cut into large chunks that a few threads read with
`pread` (the disk sees several large requests at once; from the page cache, several copies run at once) into
pinned buffers, each thread copying its chunk's pieces to their tensors on its own CUDA stream while it reads
the next. Every tensor gets its own memory, as with `load_file`. (On the CPU the loader keeps `load_file`:
its mapped tensors cost nothing at startup.)

The layout read is the safetensors format: an 8-byte little-endian header length N, N bytes of JSON header
({name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}), then the tensors' bytes; the header is
checked to describe exactly the bytes that follow before anything is allocated, so a damaged file fails with
a ValueError naming what is wrong instead of allocating what a corrupt shape asks for.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.checkpoints.reader import SAFETENSORS_DTYPES

CHUNK_BYTES = 32 * 1024 * 1024  # per read: large enough that a disk streams, small enough to pin quickly
READ_THREADS = 4  # reads in flight; each thread holds two pinned chunks (one read while the other copies)
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: where its bytes lie (absolute file offsets) and what they are."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(fd: int, file_size: int) -> list[TensorEntry]:
    """The tensors of the file open as `fd` (`file_size` bytes), in file order. A ValueError saying what is
    wrong unless they cover the data section exactly, back to back."""
    prefix = os.pread(fd, 8, 0)
    if len(prefix) != 8:
        raise ValueError(f"the file is {file_size} bytes, too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
        raise ValueError(f"the header length {header_len} exceeds the file ({file_size} bytes) or "
                         f"{_MAX_HEADER_BYTES} bytes")
    try:
        header = json.loads(os.pread(fd, header_len, 8))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"the header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    data_start = 8 + header_len
    entries = sorted((_entry(name, raw, data_start) for name, raw in header.items() if name != "__metadata__"),
                     key=lambda e: (e.start, e.end))
    position = data_start
    for entry in entries:
        if entry.start != position:
            raise ValueError(f"tensor {entry.name!r} starts at data offset {entry.start - data_start}, expected "
                             f"{position - data_start}: the tensors must cover the data back to back")
        position = entry.end
    if position != file_size:
        raise ValueError(f"the tensors end at byte {position} but the file has {file_size} bytes")
    return entries


def _entry(name: str, raw: object, data_start: int) -> TensorEntry:
    if not isinstance(raw, dict):
        raise ValueError(f"tensor {name!r}: its header entry is not an object")
    dtype_name, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    dtype = SAFETENSORS_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise ValueError(f"tensor {name!r}: dtype {dtype_name!r} is not one of {', '.join(SAFETENSORS_DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    numel = 1
    for dim in shape:
        numel *= dim
    if offsets[1] - offsets[0] != numel * dtype.itemsize:
        raise ValueError(f"tensor {name!r}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but "
                         f"dtype {dtype_name} shape {shape} needs {numel * dtype.itemsize}")
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def read_weights(path: str | Path, device: torch.device, *, chunk_bytes: int = CHUNK_BYTES,
                 threads: int = READ_THREADS) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file at `path`, each in its own memory on `device`, in file order.
    OSError when the file cannot be read; ValueError when it is not a well-formed safetensors file."""
    if chunk_bytes < 1 or threads < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes} and threads={threads} must be positive")
    if device.type == "cuda" and device.index is None:  # the reading threads need it spelt out
        device = torch.device("cuda", torch.cuda.current_device())
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        entries = read_header(fd, os.fstat(fd).st_size)
        tensors = {e.name: torch.empty(e.shape, dtype=e.dtype, device=device) for e in entries}
        if device.type == "cuda":  # the copies run on other streams: nothing may still use this memory
            torch.cuda.current_stream(device).synchronize()
        if entries and entries[-1].end > entries[0].start:
            _ChunkCopy(fd, entries, tensors, device, chunk_bytes).run(threads)
    if device.type == "cuda":  # the pinned chunks go back to the system, not to torch's cache of pinned blocks
        empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty_host_cache is not None:
            empty_host_cache()
    return tensors


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's own bytes (flattened first: a 0-dim tensor has no byte view)."""
    return tensor.reshape(-1).view(torch.uint8)


class _ChunkCopy:
    """The data section cut into chunks; thread k of n reads chunks k, k+n, ... and copies their pieces."""

    def __init__(self, fd: int, entries: list[TensorEntry], tensors: dict[str, torch.Tensor], device: torch.device,
                 chunk_bytes: int) -> None:
        self.fd = fd
        self.entries = entries
        self.ends = [e.end for e in entries]
        self.destinations = [_bytes_of(tensors[e.name]) for e in entries]
        self.device = device
        first, last = entries[0].start, entries[-1].end
        self.chunk_bytes = min(chunk_bytes, last - first)
        self.chunks = [(lo, min(lo + self.chunk_bytes, last)) for lo in range(first, last, self.chunk_bytes)]
        self.failed = threading.Event()  # one thread's error stops the others at their next chunk

    def run(self, threads: int) -> None:
        threads = min(threads, len(self.chunks), os.cpu_count() or 1)
        if threads == 1:
            self._thread(0, 1)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="kiln-weights") as pool:
            futures = [pool.submit(self._thread, k, threads) for k in range(threads)]
        for future in futures:
            future.result()  # the first error, if any

    def _thread(self, k: int, n: int) -> None:
        try:
            if self.device.type != "cuda":
                self._read_share(k, n, None)
                return
            # A new thread's current device is GPU 0: pinned buffers, stream and events belong to ours.
            with torch.cuda.device(self.device):
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    self._read_share(k, n, stream)
                stream.synchronize()
        except BaseException:
            self.failed.set()
            raise

    def _read_share(self, k: int, n: int, stream: torch.cuda.Stream | None) -> None:
        """Chunks k, k+n, ...: each read into a buffer and copied out; on a GPU two pinned buffers take turns,
        one read into while the other's copies run, and a buffer is read into again once its copies are done."""
        buffers = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=stream is not None)
                   for _ in range(1 if stream is None else 2)]
        events: list[torch.cuda.Event | None] = [None] * len(buffers)
        for j, (lo, hi) in enumerate(self.chunks[k::n]):
            if self.failed.is_set():
                return
            slot = j % len(buffers)
            if events[slot] is not None:
                events[slot].synchronize()
            buffer = buffers[slot][:hi - lo]
            _pread_exactly(self.fd, buffer.numpy(), lo)
            self._copy_pieces(buffer, lo, hi, non_blocking=stream is not None)
            if stream is not None:
                events[slot] = stream.record_event()

    def _copy_pieces(self, buffer: torch.Tensor, lo: int, hi: int, non_blocking: bool) -> None:
        """Copies the bytes of file range [lo, hi), held in `buffer`, to the tensors they belong to."""
        i = bisect.bisect_right(self.ends, lo)  # the first tensor ending after lo
        while i < len(self.entries) and self.entries[i].start < hi:
            entry = self.entries[i]
            a, b = max(entry.start, lo), min(entry.end, hi)
            if b > a:
                self.destinations[i][a - entry.start:b - entry.start].copy_(buffer[a - lo:b - lo],
                                                                            non_blocking=non_blocking)
            i += 1


def _pread_exactly(fd: int, buffer, offset: int) -> None:
    """Fills `buffer` (a writable buffer) from the file at `offset`; a file that ends early is a ValueError."""
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            raise ValueError(f"the file ended at byte {offset + done}, {len(view) - done} bytes early "
                             f"(changed while being read?)")
        done += n
