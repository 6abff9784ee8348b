"""Weight files listed with per-chunk sha256s: written by the build without a second read, verified chunk by
chunk on several threads, refused naming the chunk that differs; manifests without chunks verify as before,
and malformed chunk keys fail in one line naming file, key and value."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from kiln.builder import build as build_module
from kiln.builder.safetensors_writer import TensorSpec, write_safetensors_streaming
from kiln.engine_format import EngineError, FileEntry
from kiln.engine_format import verify as verify_module
from kiln.engine_format.chunks import DEFAULT_CHUNK_BYTES, ChunkHasher
from kiln.engine_format.spec import load_engine_spec
from kiln.engine_format.stamps import stamp_file

CHUNK = 4 << 20  # the tiny engine's 60 MiB weights in 16 chunks
RANK0 = "rank0.safetensors"


@pytest.fixture(scope="module")
def chunked_engine(tmp_path_factory):
    """kiln-tiny-code built with 4 MiB weight chunks (the builder's chunk size lowered for the test)."""
    from serve_util import build_tiny_code_engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build_module, "WEIGHT_CHUNK_BYTES", CHUNK)
        return build_tiny_code_engine(tmp_path_factory.mktemp("chunked") / "engine")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Stamps go to a private cache: every test starts as a fresh machine does."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def engine(chunked_engine, tmp_path):
    return Path(shutil.copytree(chunked_engine, tmp_path / "engine"))


@pytest.fixture
def hashed(monkeypatch):
    """Every hash made while verifying: ("whole", name) or ("chunk", name, begin, thread name)."""
    seen: list[tuple] = []
    real_file, real_range = verify_module.file_sha256, verify_module.range_sha256

    def file_sha256(path, stop=None):
        seen.append(("whole", Path(path).name))
        return real_file(path, stop)

    def range_sha256(path, begin, end, stop=None):
        seen.append(("chunk", Path(path).name, begin, threading.current_thread().name))
        return real_range(path, begin, end, stop)

    monkeypatch.setattr(verify_module, "file_sha256", file_sha256)
    monkeypatch.setattr(verify_module, "range_sha256", range_sha256)
    return seen


def manifest(engine: Path) -> dict:
    return json.loads((engine / "engine.json").read_text())["files"]


def edit_entry(engine: Path, rel_path: str, change) -> None:
    doc = json.loads((engine / "engine.json").read_text())
    change(doc["files"][rel_path])
    (engine / "engine.json").write_text(json.dumps(doc))


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def test_the_build_lists_the_weight_chunks_and_they_match(engine):
    files = manifest(engine)
    entry = files[RANK0]
    data = (engine / RANK0).read_bytes()
    assert entry["chunk_bytes"] == CHUNK and len(entry["chunk_sha256"]) == -(-len(data) // CHUNK) > 1
    assert entry["chunk_sha256"] == [hashlib.sha256(data[i:i + CHUNK]).hexdigest()
                                     for i in range(0, len(data), CHUNK)]
    assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["size"] == len(data)
    # small files keep the whole-file hash only
    assert all(set(e) == {"size", "sha256"} for rel, e in files.items() if rel != RANK0)
    spec = load_engine_spec(engine, verify_checksums=False)
    assert spec.files[RANK0].chunk_bytes == CHUNK and spec.files[RANK0].chunk_sha256 == tuple(entry["chunk_sha256"])


def test_chunks_are_hashed_on_several_threads_at_once_and_stamped(engine, hashed, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # the pool's size does not depend on the test machine
    both_running = threading.Barrier(2, timeout=30)
    recorded = verify_module.range_sha256  # the `hashed` recorder
    first_two = iter(range(2))

    def meet_then_hash(path, begin, end, stop=None):
        if next(first_two, None) is not None:
            both_running.wait()  # the first two chunks are hashed at the same time, or this times out
        return recorded(path, begin, end, stop)

    monkeypatch.setattr(verify_module, "range_sha256", meet_then_hash)
    load_engine_spec(engine)  # verifies
    chunks = [h for h in hashed if h[0] == "chunk"]
    size = (engine / RANK0).stat().st_size
    assert sorted(begin for _, _, begin, _ in chunks) == list(range(0, size, CHUNK))
    assert len({thread for *_, thread in chunks}) > 1
    assert ("whole", RANK0) not in hashed and ("whole", "tokenizer.json") in hashed
    assert RANK0 in json.loads(stamp_file(engine).read_text())["files"]
    hashed.clear()
    load_engine_spec(engine)  # stamped: the next load reads nothing
    assert hashed == []


def test_a_byte_flipped_in_the_middle_is_refused_naming_the_file_and_chunk(engine):
    size = (engine / RANK0).stat().st_size
    offset = size // 2
    flip_byte(engine / RANK0, offset)
    index, count = offset // CHUNK, -(-size // CHUNK)
    begin = index * CHUNK
    with pytest.raises(EngineError, match=r"rank0\.safetensors has sha256 that differs from the manifest's") as info:
        load_engine_spec(engine)
    assert f"modified or corrupt (chunk {index} of {count}, bytes {begin}..{begin + CHUNK - 1}, differs)" in \
        str(info.value)
    assert not stamp_file(engine).exists() or RANK0 not in stamp_file(engine).read_text()


def test_two_bad_chunks_are_counted(engine):
    flip_byte(engine / RANK0, 5)
    flip_byte(engine / RANK0, 3 * CHUNK + 7)
    with pytest.raises(EngineError, match=r"\(chunk 0 of \d+, bytes 0\.\.4194303, differs, and 1 more chunk\(s\)\)"):
        load_engine_spec(engine)


def test_an_old_manifest_without_chunks_verifies_by_the_whole_file(engine, hashed):
    edit_entry(engine, RANK0, lambda e: (e.pop("chunk_bytes"), e.pop("chunk_sha256")))
    spec = load_engine_spec(engine)
    assert spec.files[RANK0].chunk_sha256 is None and spec.files[RANK0].chunks == []
    assert ("whole", RANK0) in hashed and not any(h[0] == "chunk" for h in hashed)
    flip_byte(engine / RANK0, (engine / RANK0).stat().st_size // 2)
    with pytest.raises(EngineError, match=r"rank0\.safetensors has sha256 that differs from the manifest's [0-9a-f]{64}: "
                                          r"modified or corrupt(;|\.)"):
        load_engine_spec(engine)


def test_unknown_entry_keys_are_ignored(engine):
    """What lets older kilns read engines with chunk keys, and this one read a later kiln's optional keys."""
    edit_entry(engine, RANK0, lambda e: e.__setitem__("some_later_key", [1, 2]))
    load_engine_spec(engine)


GOOD = "0" * 64


@pytest.mark.parametrize("change, message", [
    (lambda e: e.pop("chunk_sha256"), "has 'chunk_bytes' without 'chunk_sha256': give both or neither"),
    (lambda e: e.pop("chunk_bytes"), "has 'chunk_sha256' without 'chunk_bytes': give both or neither"),
    (lambda e: e.__setitem__("chunk_bytes", 1000), "'chunk_bytes'=1000 must be a multiple of 1048576 bytes"),
    (lambda e: e.__setitem__("chunk_bytes", 0), "'chunk_bytes'=0 must be a multiple of 1048576 bytes"),
    (lambda e: e.__setitem__("chunk_bytes", True), "'chunk_bytes'=True must be"),
    (lambda e: e.__setitem__("chunk_bytes", 1 << 40), f"'chunk_bytes'={1 << 40} must be a multiple of 1048576 bytes "
                                                       f"from 1048576 to 4294967296"),
    (lambda e: e.__setitem__("chunk_bytes", "4194304"), "'chunk_bytes'='4194304' must be"),
    (lambda e: e.__setitem__("chunk_sha256", GOOD), "'chunk_sha256'='000"),
    (lambda e: e["chunk_sha256"].pop(), "'chunk_sha256' has 15 digest(s), but size 62946184 in chunks of 4194304 "
                                        "bytes needs 16"),
    (lambda e: e.__setitem__("chunk_bytes", 8 << 20), "'chunk_sha256' has 16 digest(s), but size 62946184 in chunks "
                                                      "of 8388608 bytes needs 8"),
    (lambda e: e["chunk_sha256"].__setitem__(3, "AB" * 32), "'chunk_sha256'[3]='ABAB"),
    (lambda e: e["chunk_sha256"].__setitem__(2, None), "'chunk_sha256'[2]=None must be a 64-character lowercase hex"),
])
def test_malformed_chunk_keys_are_refused_naming_the_key(engine, change, message):
    edit_entry(engine, RANK0, change)
    with pytest.raises(EngineError) as info:
        load_engine_spec(engine, verify_checksums=False)
    text = str(info.value)
    assert f"engine.json field 'files'['rank0.safetensors'] {message}" in text, text
    assert text.endswith(f"rebuild the engine with `kiln build --checkpoint ... --output {engine}`"), text


def test_a_file_entry_checks_its_chunks_and_writes_them_only_when_present():
    plain = FileEntry(10, GOOD)
    assert plain.to_json() == {"size": 10, "sha256": GOOD} and plain.chunks == []
    size = 2 * (1 << 20) + 5
    chunked = FileEntry(size, GOOD, 1 << 20, (GOOD, GOOD, GOOD))
    assert chunked.to_json()["chunk_sha256"] == [GOOD] * 3
    assert [(b, e) for b, e, _ in chunked.chunks] == [(0, 1 << 20), (1 << 20, 2 << 20), (2 << 20, size)]
    with pytest.raises(ValueError, match="needs 3"):
        FileEntry(size, GOOD, 1 << 20, (GOOD,))


def test_the_chunk_hasher_cuts_at_chunk_boundaries_whatever_the_pieces():
    data = bytes(range(256)) * 41  # 10496 bytes
    hasher = ChunkHasher(1000)
    for begin, end in [(0, 3), (3, 1000), (1000, 1001), (1001, 5555), (5555, 10496)]:
        hasher.update(data[begin:end])
    assert hasher.digests() == tuple(hashlib.sha256(data[i:i + 1000]).hexdigest() for i in range(0, len(data), 1000))


def test_the_writer_lists_chunks_only_for_a_file_longer_than_one(tmp_path):
    specs = [TensorSpec("w", torch.float32, (3 << 18,))]  # 3 MiB
    small = write_safetensors_streaming(tmp_path / "small.safetensors", specs, lambda s: torch.ones(s.shape))
    assert small.chunk_sha256 is None and small.chunk_bytes is None
    from kiln.builder.safetensors_writer import SafetensorsStream

    with SafetensorsStream(tmp_path / "big.safetensors", specs, chunk_bytes=1 << 20) as stream:
        stream.add(torch.arange(3 << 18, dtype=torch.float32))
        big = stream.finish()
    data = big.path.read_bytes()
    assert big.chunk_bytes == 1 << 20 and len(big.chunk_sha256) == 4  # header + 3 MiB of data
    assert big.chunk_sha256 == tuple(hashlib.sha256(data[i:i + (1 << 20)]).hexdigest()
                                     for i in range(0, len(data), 1 << 20))
    assert DEFAULT_CHUNK_BYTES == 256 << 20
