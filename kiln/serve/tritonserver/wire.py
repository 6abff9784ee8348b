"""Triton's raw tensor encoding, shared by the HTTP binary-data extension and gRPC raw contents.

Numeric elements are little-endian arrays; each BYTES element is a 4-byte little-endian length, then the bytes.
Every problem raises `InvalidRequest` naming the tensor. A declared shape is checked before any data is read
(numpy fails, or allocates without bound, on shapes such as [2**63, 0] or 100 dimensions).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np

from kiln.serve.client_json import surrogate_error
from kiln.serve.errors import InvalidRequest
from kiln.serve.tritonserver.schema import DATATYPES

MAX_DIMS = 8  # kiln's tensors have 2; Triton's clients send no more than a few
MAX_ELEMENTS = 2**31  # per tensor, counting only its non-zero dimensions: far above what a body can carry


def _wire_dtype(datatype: str) -> np.dtype:
    return np.dtype(DATATYPES[datatype][1]).newbyteorder("<")


def object_array(items: list) -> np.ndarray:
    """A 1-D object array holding the items as they are (BYTES tensors are held so)."""
    array = np.empty(len(items), dtype=np.object_)
    array[:] = items
    return array


def decode_raw(name: str, datatype: str, raw: bytes, shape: Sequence[int], *,
               where: str = "raw data") -> np.ndarray:
    """Input `name`'s raw bytes -> an array of `shape` (BYTES: an object array of bytes). `where` names the raw
    data in the error when the element count does not match the shape."""
    check_shape(name, shape)
    if datatype != "BYTES":
        dtype = _wire_dtype(datatype)
        if len(raw) % dtype.itemsize:
            raise InvalidRequest(f"input '{name}': {len(raw)} raw bytes are not a whole number of {datatype} "
                                 "elements", name)
        values = np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="))
    else:
        items, offset = [], 0
        while offset < len(raw):
            if offset + 4 > len(raw):
                raise InvalidRequest(f"input '{name}': raw BYTES contents end inside an element's length", name)
            (length,) = struct.unpack_from("<I", raw, offset)
            offset += 4
            if offset + length > len(raw):
                raise InvalidRequest(f"input '{name}': a raw BYTES element says {length} bytes but fewer are left "
                                     "(each element is a 4-byte little-endian length, then the bytes)", name)
            items.append(raw[offset:offset + length])
            offset += length
        values = object_array(items)
    return reshape(name, values, shape, where)


def reshape(name: str, values: np.ndarray, shape: Sequence[int], where: str) -> np.ndarray:
    """Input `name`'s flat values -> an array of `shape`; `where` names the values in the error when their
    count does not match."""
    count = math.prod(check_shape(name, shape))
    if values.size != count:
        raise InvalidRequest(f"input '{name}' has {values.size} elements in {where} but its shape {list(shape)} "
                             f"needs {count}", name)
    return values.reshape(shape)


def check_shape(name: str, shape: Sequence[int]) -> tuple[int, ...]:
    """Input `name`'s declared shape, if numpy can hold it and a request could fill it; else InvalidRequest."""
    dims = tuple(shape)
    if len(dims) > MAX_DIMS or not all(isinstance(d, int) and 0 <= d < MAX_ELEMENTS for d in dims) \
            or math.prod(d for d in dims if d) >= MAX_ELEMENTS:
        shown = list(dims) if len(dims) <= MAX_DIMS else f"[{', '.join(map(str, dims[:MAX_DIMS]))}, ...]"
        raise InvalidRequest(f"input '{name}' has shape {shown} ({len(dims)} dimensions), which is invalid: a shape "
                             f"has at most {MAX_DIMS} dimensions, each in [0, 2**31), and fewer than 2**31 elements "
                             "not counting its 0 dimensions", name)
    return dims


def utf8(name: str, text: str) -> bytes:
    """A BYTES element given as text (JSON) -> its UTF-8 bytes; InvalidRequest if it holds a lone surrogate."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise surrogate_error(f"input '{name}'", text, name) from None


def encode_raw(datatype: str, array: np.ndarray) -> bytes:
    """An array -> its raw bytes as `datatype` (BYTES: an array of bytes)."""
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(item)) + item for item in array.flat)
    return np.ascontiguousarray(array, dtype=_wire_dtype(datatype)).tobytes()
