"""Streaming .safetensors writer: one tensor in memory at a time, hashed while written.

File layout (https://github.com/huggingface/safetensors#format):
  8 bytes   little-endian u64 N, the header length
  N bytes   UTF-8 JSON header {"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}, ...},
            padded with spaces to a multiple of 8 so the data section starts aligned
  rest      raw little-endian tensor bytes, in header order; data_offsets are relative to this section
"""

from __future__ import annotations

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

# safetensors dtype name -> torch dtype. The reader (checkpoint.py) uses the same table.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
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


@dataclass(frozen=True)
class WrittenFile:
    """A finished file: its final path, its size in bytes and the sha256 hex digest of all its bytes."""

    path: Path
    size: int
    sha256: str


def safetensors_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors header name of a torch dtype ("BF16", ...); ValueError if safetensors has none."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        supported = ", ".join(str(d) for d in _DTYPE_NAMES)
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors; supported: {supported}") from None


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
    if sys.byteorder != "little":
        # safetensors stores little-endian bytes; we copy memory as is.
        raise RuntimeError(f"writing safetensors needs a little-endian machine, this one is {sys.byteorder}")
    path = Path(path)
    header = _encode_header(specs, metadata)
    total_size = len(header) + sum(spec.nbytes for spec in specs)
    partial = path.with_name(path.name + ".partial")
    digest = hashlib.sha256()
    try:
        with (
            open(partial, "wb") as out,
            tqdm(
                total=total_size, unit="B", unit_scale=True, desc=desc or path.name, disable=not progress
            ) as bar,
        ):

            def emit(data: bytes | memoryview) -> None:
                out.write(data)
                digest.update(data)
                bar.update(len(data))

            emit(header)
            for spec in specs:
                tensor = _checked(spec, produce(spec))
                data = memoryview(_as_bytes(tensor))
                for begin in range(0, len(data), _WRITE_CHUNK_BYTES):
                    emit(data[begin : begin + _WRITE_CHUNK_BYTES])
                del tensor, data  # drop the reference before producing the next one
            out.flush()
            os.fsync(out.fileno())
            written = out.tell()
        if written != total_size:
            raise RuntimeError(f"{partial}: wrote {written} bytes, header promised {total_size}")
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return WrittenFile(path=path, size=total_size, sha256=digest.hexdigest())


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
