"""One KV block as a file of the disk tier: the engine's KV identity, the file's name, header and checks.

Plain Python (hashlib, struct, json), no torch: the bytes of a block are opaque here. A file is

    header (fixed, `HEADER.size` bytes) | block hash (`hash_len` bytes) | payload (`payload_len` bytes)

with the header holding the magic, this format's version, the full 32-byte KV identity of the engine that
wrote it, the payload's length and its blake2b-256 checksum. A reader checks all of them before it trusts a
payload, so a truncated, corrupted or foreign file is never loaded (kv_disk_tier.py counts and deletes it).
The directory helpers at the end list a directory's block files and check that it can be written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# Version of the block file and of the identity recipe; part of the identity, so files written by another
# version carry another name prefix and are ignored (counted foreign), never misread.
FORMAT_VERSION = 1
MAGIC = b"KILNKVB\0"
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
IDENTITY_BYTES = 32
MAX_HASH_BYTES = 64  # a block hash is a sha256 (32 bytes); 64 keeps its file name within NAME_MAX
PREFIX_HEX_CHARS = 16  # the identity's first 8 bytes name the files; the header holds all 32

# magic, version, hash_len, identity, payload_len, payload checksum (blake2b-256)
HEADER = struct.Struct("<8sHH32sQ32s")

# engine.json build_config keys that bound the runtime but never change a block's KV: a rebuild with another
# max_batch_size keeps the cache.
_KV_NEUTRAL_BUILD_KEYS = frozenset({"max_batch_size", "max_num_tokens", "max_seq_len", "max_beam_width"})
_WEIGHT_FILE = re.compile(r"rank\d+\.safetensors")


class _FileEntryLike(Protocol):
    sha256: str


class EngineSpecLike(Protocol):
    """What kv_identity reads of an `EngineSpec` (kiln/engine_format/spec.py)."""

    architecture: str
    model_config: dict
    build_config: dict
    target: dict
    files: dict[str, Any]  # manifest path -> FileEntry (its .sha256)


def kv_identity(engine_spec: EngineSpecLike, *, kv_cache_dtype: str, block_size: int, tp_size: int,
                tp_rank: int, block_bytes: int) -> bytes:
    """The engine's identity for its KV blocks (32 bytes, sha256): two engines share a block file only when
    a block's bytes mean the same in both.

    Hashed: the manifest sha256 of every weight file (`rank<N>.safetensors`; not the tokenizer, whose files
    never change the KV), the architecture, engine.json's model_config and build_config (less the runtime
    limits, _KV_NEUTRAL_BUILD_KEYS), the KV dtype, block size, TP size and rank, the block's byte size and
    FORMAT_VERSION. An engine whose dummy weights are drawn at load has no weight files: its weights come
    from seed 0 on its target device, so the target's device_type stands in for them.
    """
    if not isinstance(kv_cache_dtype, str) or not kv_cache_dtype:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be a non-empty string")
    for name, value, low in (("block_size", block_size, 1), ("tp_size", tp_size, 1),
                             ("block_bytes", block_bytes, 1), ("tp_rank", tp_rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    if tp_rank >= tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be below tp_size={tp_size}")
    weights = {path: entry.sha256 for path, entry in engine_spec.files.items() if _WEIGHT_FILE.fullmatch(path)}
    document = {
        "format_version": FORMAT_VERSION,
        "architecture": engine_spec.architecture,
        "weights": weights,
        "weights_device": None if weights else engine_spec.target.get("device_type"),
        "model_config": engine_spec.model_config,
        "build_config": {k: v for k, v in engine_spec.build_config.items() if k not in _KV_NEUTRAL_BUILD_KEYS},
        "kv_cache_dtype": kv_cache_dtype,
        "block_size": block_size,
        "tp_size": tp_size,
        "tp_rank": tp_rank,
        "block_bytes": block_bytes,
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).digest()


def name_prefix(identity: bytes) -> str:
    """The start of every block file name of `identity` (`<identity hex[:16]>-`)."""
    return identity.hex()[:PREFIX_HEX_CHARS] + "-"


def check_block_hash(block_hash: object) -> None:
    """A ValueError unless `block_hash` is 1..MAX_HASH_BYTES bytes (the block manager's chain hash)."""
    if not isinstance(block_hash, bytes) or not 1 <= len(block_hash) <= MAX_HASH_BYTES:
        raise ValueError(f"block_hash={block_hash!r:.80} must be 1 to {MAX_HASH_BYTES} bytes")


def block_file_name(identity: bytes, block_hash: bytes) -> str:
    """`<identity hex[:16]>-<block hash hex>.kvb`."""
    return f"{name_prefix(identity)}{block_hash.hex()}{SUFFIX}"


def temp_file_name(identity: bytes, block_hash: bytes, token: str) -> str:
    """The name a block file is written under before it is renamed into place: hidden (a leading dot), never
    ending in `.kvb`, unique per writer (`token`)."""
    return f".{block_file_name(identity, block_hash)}.{token}{TMP_SUFFIX}"


def is_temp_of(name: str, identity: bytes) -> bool:
    return name.startswith("." + name_prefix(identity)) and name.endswith(TMP_SUFFIX)


def parse_block_name(name: str, identity: bytes) -> bytes | None:
    """The block hash a file of `identity` is named for; None when `name` is not one of its block files."""
    prefix = name_prefix(identity)
    if not (name.startswith(prefix) and name.endswith(SUFFIX)):
        return None
    hex_part = name[len(prefix):-len(SUFFIX)]
    if not hex_part or len(hex_part) % 2 or hex_part != hex_part.lower():
        return None
    try:
        return bytes.fromhex(hex_part)
    except ValueError:
        return None


def checksum(payload: bytes | memoryview) -> bytes:
    # blake2b: as safe as sha256 against accidental damage and faster on CPUs without SHA extensions.
    return hashlib.blake2b(payload, digest_size=32).digest()


def pack_header(identity: bytes, block_hash: bytes, payload: bytes | memoryview) -> bytes:
    """The header and block hash that precede `payload` in its file."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, len(block_hash), identity, len(payload),
                       checksum(payload)) + block_hash


def file_size(block_hash: bytes, payload_len: int) -> int:
    """Bytes on disk (the file's length) of a block file."""
    return HEADER.size + len(block_hash) + payload_len


@dataclass(frozen=True)
class Header:
    """A block file's parsed header."""

    identity: bytes
    block_hash: bytes
    payload_len: int
    checksum: bytes

    @property
    def size(self) -> int:
        return HEADER.size + len(self.block_hash)


class CorruptBlockFile(Exception):
    """The file is damaged: bad magic or version, truncated, another length or a bad checksum."""


class ForeignBlockFile(Exception):
    """The file is intact but was written for another identity (or names another block)."""


def parse_header(head: bytes, hash_len: int) -> Header:
    """The header of a file starting with `head` (at least HEADER.size + hash_len bytes, when the file has
    them); CorruptBlockFile when it is short or not a block file of this format."""
    if len(head) < HEADER.size:
        raise CorruptBlockFile(f"truncated header ({len(head)} of {HEADER.size} bytes)")
    magic, version, stored_hash_len, identity, payload_len, digest = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise CorruptBlockFile("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptBlockFile(f"format version {version}, expected {FORMAT_VERSION}")
    if stored_hash_len != hash_len:
        raise CorruptBlockFile(f"block hash of {stored_hash_len} bytes, expected {hash_len}")
    if len(head) < HEADER.size + hash_len:
        raise CorruptBlockFile(f"truncated header ({len(head)} of {HEADER.size + hash_len} bytes)")
    return Header(identity, bytes(head[HEADER.size:HEADER.size + hash_len]), payload_len, digest)


def check_block(header: Header, payload: bytes, *, identity: bytes, block_hash: bytes, payload_len: int,
                actual_size: int) -> None:
    """Raises ForeignBlockFile / CorruptBlockFile unless the file (`actual_size` bytes long) holds exactly
    `block_hash`'s `payload_len` bytes for `identity` with a matching checksum."""
    if header.identity != identity or header.block_hash != block_hash:
        raise ForeignBlockFile("written for another engine identity or block")
    if header.payload_len != payload_len:
        raise CorruptBlockFile(f"payload of {header.payload_len} bytes, expected {payload_len}")
    if actual_size != header.size + payload_len or len(payload) != payload_len:
        raise CorruptBlockFile(f"file of {actual_size} bytes, expected {header.size + payload_len}")
    if checksum(payload) != header.checksum:
        raise CorruptBlockFile("payload checksum mismatch")


# -- the directory --------------------------------------------------------------------------------------------


def prepare_directory(directory: Path, flag: str) -> None:
    """Create `directory` and check that files can be written in it; a ValueError naming `flag` if not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kiln-kv-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag}={str(directory)!r} cannot be created or written: {e}; pass a writable "
                         f"directory") from e


def list_block_files(directory: Path, identity: bytes,
                     temp_grace_seconds: float) -> tuple[list[tuple[bytes, int]], int]:
    """(`identity`'s block files as (block hash, bytes), oldest mtime first; the number of other `.kvb`
    files). Deletes `identity`'s temporary files older than `temp_grace_seconds` (a younger one may be a
    live writer's, in another process sharing the directory)."""
    found: list[tuple[int, str, bytes, int]] = []  # (mtime_ns, name, hash, size)
    foreign = 0
    now = time.time()
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            try:
                if is_temp_of(name, identity):
                    if now - entry.stat(follow_symlinks=False).st_mtime >= temp_grace_seconds:
                        unlink_quietly(directory / name)
                    continue
                if not name.endswith(SUFFIX) or not entry.is_file(follow_symlinks=False):
                    continue
                block_hash = parse_block_name(name, identity)
                if block_hash is None:
                    foreign += 1
                    continue
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed while listing (another process's eviction)
                continue
            found.append((stat.st_mtime_ns, name, block_hash, stat.st_size))
    found.sort()
    return [(block_hash, size) for _, _, block_hash, size in found], foreign


def unlink_quietly(path: Path) -> None:
    """Delete `path` if it exists; a failure is logged, never raised (the cache goes on without it)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("KV disk tier: cannot delete %s: %s", path, e)
