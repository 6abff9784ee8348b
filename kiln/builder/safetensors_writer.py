"""Streaming .safetensors writer: one tensor in memory at a time, hashed while written.

File layout (https://github.com/huggingface/safetensors#format):
  8 bytes   little-endian u64 N, the header length
  N bytes   UTF-8 JSON header {"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}, ...},
            padded with spaces to a multiple of 8 so the data section starts aligned
  rest      raw little-endian tensor bytes, in header order; data_offsets are relative to this section
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kiln.checkpoints.reader import SAFETENSORS_DTYPES
from kiln.engine_format.chunks import ChunkHasher

_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

# Large tensors go out in slices so the progress bar moves and no extra copy is made.
_WRITE_CHUNK_BYTES = 16 * 1024 * 1024
_HEADER_ALIGNMENT = 8


@dataclass(frozen=True)
class TensorSpec:
    """What one tensor of the file will be; the header is written from these before any data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


def specs_of(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    """The specs of named tensors (a meta network's state_dict), in their order."""
    return [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


@dataclass(frozen=True)
class WrittenFile:
    """A finished file: its final path, its size in bytes and the sha256 hex digest of all its bytes; and when
    it was written with `chunk_bytes` and is longer than one chunk, the sha256 of each chunk (else None)."""

    path: Path
    size: int
    sha256: str
    chunk_bytes: int | None = None
    chunk_sha256: tuple[str, ...] | None = None


def safetensors_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors header name of a torch dtype ("BF16", ...); ValueError if safetensors has none."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        supported = ", ".join(str(d) for d in _DTYPE_NAMES)
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors; supported: {supported}") from None


class SafetensorsStream:
    """One .safetensors file written tensor by tensor, in the order of its specs.

    The header is written at once from the specs; each `add` checks the tensor against the next spec
    and writes its bytes, hashed as they go, so only the tensor being added is held. The file is
    `<path>.partial` until `finish` renames it, so a file at `path` is always complete; a stream closed
    without `finish` (an exception in its `with` block) deletes its partial file. `on_write(n)`, when set,
    is told of every n bytes written after it was set (a progress bar; `bytes_written` counts all).
    `chunk_bytes`: also hash every consecutive `chunk_bytes` of the file as it is written (manifest chunks,
    see `engine_format.chunks`), kept for a file longer than one chunk.
    """

    def __init__(self, path: str | Path, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None,
                 on_write: Callable[[int], None] | None = None, chunk_bytes: int | None = None) -> None:
        if sys.byteorder != "little":
            # safetensors stores little-endian bytes; we copy memory as is.
            raise RuntimeError(f"writing safetensors needs a little-endian machine, this one is {sys.byteorder}")
        self.path = Path(path)
        self.specs = list(specs)
        header = _encode_header(self.specs, metadata)  # bad specs fail before a file exists
        self.size = len(header) + sum(spec.nbytes for spec in self.specs)
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._digest = hashlib.sha256()
        # The same bytes hashed again per chunk as they go out: no second read of the file.
        self._chunks = None if chunk_bytes is None or self.size <= chunk_bytes else ChunkHasher(chunk_bytes)
        self.on_write = on_write
        self.bytes_written = 0
        self._added = 0
        self._out = open(self._partial, "wb")
        try:
            self._emit(header)
        except BaseException:
            self.abort()
            raise

    def __enter__(self) -> SafetensorsStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._out.closed:
            self.abort()

    def add(self, tensor: torch.Tensor) -> None:
        """Writes the next spec's tensor; ValueError unless it has exactly that spec's dtype and shape."""
        if self._added == len(self.specs):
            raise ValueError(f"{self.path}: all {len(self.specs)} tensors of the header were written; one more "
                             f"was added")
        data = memoryview(_as_bytes(_checked(self.specs[self._added], tensor)))
        for begin in range(0, len(data), _WRITE_CHUNK_BYTES):
            self._emit(data[begin : begin + _WRITE_CHUNK_BYTES])
        self._added += 1

    def finish(self) -> WrittenFile:
        """Syncs and renames the complete file into place; ValueError if a spec's tensor was never added."""
        if self._added != len(self.specs):
            raise ValueError(f"{self.path}: {len(self.specs) - self._added} of {len(self.specs)} tensors were never "
                             f"added, the first {self.specs[self._added].name!r}")
        self._out.flush()
        os.fsync(self._out.fileno())
        written = self._out.tell()
        self._out.close()
        if written != self.size:
            self._partial.unlink(missing_ok=True)
            raise RuntimeError(f"{self._partial}: wrote {written} bytes, header promised {self.size}")
        os.replace(self._partial, self.path)
        chunks = self._chunks
        return WrittenFile(path=self.path, size=self.size, sha256=self._digest.hexdigest(),
                           chunk_bytes=None if chunks is None else chunks.chunk_bytes,
                           chunk_sha256=None if chunks is None else chunks.digests())

    def abort(self) -> None:
        """Closes and deletes the partial file (nothing at `path` is touched)."""
        self._out.close()
        self._partial.unlink(missing_ok=True)

    def _emit(self, data: bytes | memoryview) -> None:
        self._out.write(data)
        self._digest.update(data)
        if self._chunks is not None:
            self._chunks.update(data)
        self.bytes_written += len(data)
        if self.on_write is not None:
            self.on_write(len(data))


def write_safetensors_streaming(
    path: str | Path,
    specs: Sequence[TensorSpec],
    produce: Callable[[TensorSpec], torch.Tensor],
    metadata: dict[str, str] | None = None,
    progress: bool = False,
    desc: str = "",
) -> WrittenFile:
    """Write `specs` to `path` as safetensors, calling `produce(spec)` for each tensor in order.

    Only the tensor being written is held, so a file far larger than memory can be built. Each produced
    tensor must match its spec's dtype and shape exactly (ValueError otherwise). The file is written
    to `<path>.partial` and renamed at the end, so a file at `path` is always complete.
    """
    path = Path(path)
    (written,) = write_safetensors_split([path], specs, [specs], produce, lambda name, tensor, index: tensor,
                                         [metadata], progress=progress, desc=desc or path.name)
    return written


def write_safetensors_split(
    paths: Sequence[str | Path],
    specs: Sequence[TensorSpec],
    file_specs: Sequence[Sequence[TensorSpec]],
    produce: Callable[[TensorSpec], torch.Tensor],
    cut: Callable[[str, torch.Tensor, int], torch.Tensor],
    metadata: Sequence[dict[str, str] | None] | None = None,
    progress: bool = False,
    desc: str = "",
    chunk_bytes: int | None = None,
) -> list[WrittenFile]:
    """Writes one safetensors file per path in one pass: tensor k of file i is `cut(name, whole, i)` of the
    whole tensor `produce(specs[k])`, which must match `file_specs[i][k]` (tensor-parallel ranks' shares).

    Each whole tensor is produced once, and only it and one cut of it are held at a time. A failure leaves
    no partial file behind. `chunk_bytes`: each file longer than that also gets its chunks' sha256s.
    """
    metadata = [None] * len(paths) if metadata is None else list(metadata)
    if not len(paths) == len(file_specs) == len(metadata):
        raise ValueError(f"{len(paths)} paths, {len(file_specs)} spec lists and {len(metadata)} metadata: "
                         f"one of each per file")
    for path, specs_i in zip(paths, file_specs, strict=True):
        if len(specs_i) != len(specs):
            raise ValueError(f"{path}: {len(specs_i)} tensors, but {len(specs)} whole tensors are produced")
    with contextlib.ExitStack() as stack:
        streams = [stack.enter_context(SafetensorsStream(path, specs_i, meta, chunk_bytes=chunk_bytes))
                   for path, specs_i, meta in zip(paths, file_specs, metadata, strict=True)]
        bar = stack.enter_context(tqdm(total=sum(stream.size for stream in streams), unit="B", unit_scale=True,
                                       initial=sum(stream.bytes_written for stream in streams), desc=desc,
                                       disable=not progress))
        for stream in streams:
            stream.on_write = bar.update
        for spec in specs:
            whole = _checked(spec, produce(spec))
            for i, stream in enumerate(streams):
                stream.add(cut(spec.name, whole, i))
            del whole  # drop the reference before producing the next one
        return [stream.finish() for stream in streams]


def _encode_header(specs: Sequence[TensorSpec], metadata: dict[str, str] | None) -> bytes:
    """The 8-byte length prefix plus the padded JSON header for `specs`, data laid out in spec order."""
    entries: dict[str, object] = {}
    if metadata is not None:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"safetensors metadata must map str to str, got {key!r}: {value!r}")
        entries["__metadata__"] = dict(metadata)
    offset = 0
    for spec in specs:
        if spec.name == "__metadata__" or spec.name in entries:
            raise ValueError(f"tensor name {spec.name!r} is reserved or appears twice in the specs")
        if any(not isinstance(dim, int) or dim < 0 for dim in spec.shape):
            raise ValueError(f"tensor {spec.name!r}: shape {spec.shape} must be non-negative ints")
        entries[spec.name] = {
            "dtype": safetensors_dtype_name(spec.dtype),
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    body = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-len(body) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(body)) + body


def _checked(spec: TensorSpec, tensor: object) -> torch.Tensor:
    """The produced tensor, on CPU and contiguous, after checking it is what the header announced."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(
            f"tensor {spec.name!r}: produce() returned {type(tensor).__name__}, expected torch.Tensor"
        )
    if tensor.dtype != spec.dtype or tuple(tensor.shape) != tuple(spec.shape):
        raise ValueError(
            f"tensor {spec.name!r}: expected dtype {spec.dtype} shape {tuple(spec.shape)}, "
            f"got dtype {tensor.dtype} shape {tuple(tensor.shape)}"
        )
    return tensor.detach().to("cpu").contiguous()


def _as_bytes(tensor: torch.Tensor):
    """A uint8 numpy view of a contiguous CPU tensor's own bytes (not its whole storage).

    Going through uint8 works for dtypes numpy lacks (bfloat16, float8); flattening first because
    a 0-dim tensor cannot be viewed as a dtype of another element size.
    """
    return tensor.reshape(-1).view(torch.uint8).numpy()
