"""The disk tier's file store (kiln/runtime/worker/kv_disk_tier.py): round trips, restarts, damaged and foreign
files, the size limit, a full queue, concurrent reads, and the engine's KV identity."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kiln.engine_format.manifest import FileEntry
from kiln.engine_format.spec import EngineSpec
from kiln.runtime.worker import kv_block_file
from kiln.runtime.worker.kv_disk_tier import DiskKVTier, kv_identity

BLOCK = 256
FILE = kv_block_file.file_size(b"\0" * 32, BLOCK)  # bytes of one block file on disk
ID_A = hashlib.sha256(b"engine a").digest()
ID_B = hashlib.sha256(b"engine b").digest()


def h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(BLOCK))


def kvb_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.kvb"))


def disk_bytes(directory: Path) -> int:
    """The sum of the directory's file sizes (a file the writer deletes meanwhile counts 0)."""
    total = 0
    for path in directory.iterdir():
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            pass
    return total


def tier(directory: Path, identity: bytes = ID_A, limit: int = 100 * FILE, **kw) -> DiskKVTier:
    return DiskKVTier(directory, limit, identity, BLOCK, min_free_bytes=0, **kw)


def test_round_trip_and_names(tmp_path):
    with tier(tmp_path / "kv") as t:  # the directory is created
        assert t.write(h(1), memoryview(bytearray(payload(1))))
        assert t.flush(timeout=10)
        assert h(1) in t and len(t) == 1 and t.bytes_used == FILE
        assert t.read(h(1)) == payload(1)
        assert t.read(h(2)) is None
        (path,) = kvb_files(tmp_path / "kv")
        assert path.name == f"{ID_A.hex()[:16]}-{h(1).hex()}.kvb" and path.stat().st_size == FILE
        s = t.stats()
        assert (s["files"], s["bytes"], s["writes"], s["hits"], s["misses"]) == (1, FILE, 1, 1, 1)
        assert s["read_seconds"] >= 0 and s["write_seconds"] > 0


def test_caller_may_reuse_its_buffer(tmp_path):
    buffer = bytearray(payload(1))
    with tier(tmp_path) as t:
        assert t.write(h(1), memoryview(buffer))
        buffer[:] = bytes(BLOCK)  # overwritten before the writer ran, maybe
        t.flush()
        assert t.read(h(1)) == payload(1)


def test_wrong_length_is_dropped(tmp_path):
    with tier(tmp_path) as t:
        assert not t.write(h(1), b"x" * (BLOCK - 1))
        assert t.stats()["dropped"] == 1 and h(1) not in t
        with pytest.raises(ValueError, match="block_hash"):
            t.write("not bytes", payload(1))  # type: ignore[arg-type]


def test_restart_same_identity_finds_blocks_other_identity_ignores_them(tmp_path):
    with tier(tmp_path) as t:
        for i in range(3):
            t.write(h(i), payload(i))
    with tier(tmp_path) as again:
        assert len(again) == 3 and again.bytes_used == 3 * FILE
        assert [again.read(h(i)) for i in range(3)] == [payload(i) for i in range(3)]
        assert again.stats()["foreign"] == 0
    with tier(tmp_path, ID_B) as other:
        assert len(other) == 0 and other.read(h(0)) is None
        assert other.stats()["foreign"] == 3
        other.write(h(9), payload(9))
    assert len(kvb_files(tmp_path)) == 4  # another engine's files are never deleted


def test_restart_keeps_lru_order_by_mtime(tmp_path):
    with tier(tmp_path) as t:
        for i in range(3):
            t.write(h(i), payload(i))
    for i, name in enumerate((h(2), h(0), h(1))):  # oldest first: 2, 0, 1
        os.utime(tmp_path / kv_block_file.block_file_name(ID_A, name), ns=(10**18 + i, 10**18 + i))
    with tier(tmp_path, limit=3 * FILE) as t:
        t.write(h(5), payload(5))
        t.flush()
        assert h(2) not in t and {h(0), h(1), h(5)} == {x for x in map(h, range(6)) if x in t}


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "extend"])
def test_damaged_file_is_counted_corrupt_and_deleted(tmp_path, damage):
    with tier(tmp_path) as t:
        t.write(h(1), payload(1))
        t.flush()
        (path,) = kvb_files(tmp_path)
        data = bytearray(path.read_bytes())
        if damage == "flip_payload":
            data[-5] ^= 0x01
        elif damage == "flip_header":
            data[9] ^= 0x01  # the format version
        elif damage == "truncate":
            del data[-10:]
        else:
            data += b"\0"
        path.write_bytes(bytes(data))
        assert t.read(h(1)) is None
        s = t.stats()
        assert (s["corrupt"], s["misses"], s["hits"], s["files"], s["bytes"]) == (1, 1, 0, 0, 0)
        assert not path.exists() and h(1) not in t


def test_file_of_another_identity_under_our_name_is_rejected(tmp_path):
    with tier(tmp_path, ID_B) as other:
        other.write(h(1), payload(1))
    (path,) = kvb_files(tmp_path)
    path.rename(tmp_path / kv_block_file.block_file_name(ID_A, h(1)))  # a name prefix collision, say
    with tier(tmp_path) as t:
        assert h(1) in t and t.read(h(1)) is None
        assert t.stats()["rejected"] == 1 and not kvb_files(tmp_path)


def test_truncated_file_found_at_restart(tmp_path):
    with tier(tmp_path) as t:
        t.write(h(1), payload(1))
    (path,) = kvb_files(tmp_path)
    os.truncate(path, 7)
    with tier(tmp_path) as t:
        assert t.read(h(1)) is None and t.stats()["corrupt"] == 1 and not path.exists()


def test_directory_stays_within_its_limit(tmp_path):
    limit = 5 * FILE + FILE // 2
    with tier(tmp_path, limit=limit) as t:
        for i in range(40):
            assert t.write(h(i), payload(i))
            if i % 7 == 0:
                t.flush()
            assert disk_bytes(tmp_path) <= limit
        t.flush()
        on_disk = disk_bytes(tmp_path)
        assert on_disk <= limit and on_disk == t.bytes_used == 5 * FILE
        assert all(h(i) not in t for i in range(35)) and all(h(i) in t for i in range(35, 40))
        assert t.stats()["evictions"] == 35


def test_a_hit_makes_a_block_most_recent(tmp_path):
    with tier(tmp_path, limit=3 * FILE) as t:
        for i in range(3):
            t.write(h(i), payload(i))
        t.flush()
        assert t.read(h(0)) == payload(0)
        t.write(h(3), payload(3))
        t.flush()
        assert h(0) in t and h(1) not in t


def test_lowered_limit_evicts_oldest_at_scan(tmp_path):
    with tier(tmp_path) as t:
        for i in range(6):
            t.write(h(i), payload(i))
            t.flush()
            os.utime(tmp_path / kv_block_file.block_file_name(ID_A, h(i)), ns=(10**18 + i, 10**18 + i))
    with tier(tmp_path, limit=2 * FILE) as t:
        assert len(t) == 2 and h(4) in t and h(5) in t
        assert len(kvb_files(tmp_path)) == 2 and t.stats()["evictions"] == 4


def test_block_larger_than_the_limit_is_dropped(tmp_path):
    with tier(tmp_path, limit=FILE - 1) as t:
        assert t.write(h(1), payload(1))
        t.flush()
        assert len(t) == 0 and t.stats()["dropped"] == 1 and not kvb_files(tmp_path)


def test_full_queue_drops_instead_of_blocking(tmp_path, monkeypatch):
    gate = threading.Event()
    with tier(tmp_path, max_pending_writes=2) as t:
        real = t._write_one

        def slow_write(block_hash, data):
            gate.wait(10)
            real(block_hash, data)

        monkeypatch.setattr(t, "_write_one", slow_write)
        start = time.perf_counter()
        results = [t.write(h(i), payload(i)) for i in range(6)]
        assert time.perf_counter() - start < 1.0
        # the writer holds at most one block, the queue two: the rest are dropped
        assert results[:2] == [True, True] and results[-3:] == [False, False, False]
        assert t.stats()["dropped"] == results.count(False)
        gate.set()
        assert t.flush(timeout=10)
        assert len(t) == results.count(True)


def test_duplicate_writes_are_written_once(tmp_path):
    with tier(tmp_path) as t:
        assert t.write(h(1), payload(1)) and t.write(h(1), payload(1))
        t.flush()
        assert t.write(h(1), payload(1))
        t.flush()
        assert t.stats()["writes"] == 1 and t.stats()["dropped"] == 0


def test_no_space_skips_the_write(tmp_path):
    with DiskKVTier(tmp_path, 100 * FILE, ID_A, BLOCK, min_free_bytes=1 << 62) as t:
        assert t.write(h(1), payload(1))
        t.flush()
        assert len(t) == 0 and t.stats()["no_space"] == 1 and not kvb_files(tmp_path)


def test_concurrent_reads_while_writing(tmp_path):
    limit = 8 * FILE
    errors: list[str] = []
    with tier(tmp_path, limit=limit) as t:
        stop = threading.Event()

        def reader():
            while not stop.is_set():
                for i in range(60):
                    got = t.read(h(i))
                    if got is not None and got != payload(i):
                        errors.append(f"block {i} read back wrong")

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for th in threads:
            th.start()
        for i in range(60):
            t.write(h(i), payload(i))
            if i % 5 == 0:
                t.flush()
        t.flush()
        stop.set()
        for th in threads:
            th.join()
        s = t.stats()
        assert not errors and s["corrupt"] == 0 and s["rejected"] == 0 and s["hits"] > 0
        assert disk_bytes(tmp_path) <= limit


def test_leftover_temporary_file_is_removed_at_scan(tmp_path):
    ours = tmp_path / kv_block_file.temp_file_name(ID_A, h(1), "crashed")
    fresh = tmp_path / kv_block_file.temp_file_name(ID_A, h(2), "live")
    theirs = tmp_path / kv_block_file.temp_file_name(ID_B, h(1), "crashed")
    for path in (ours, fresh, theirs):
        path.write_bytes(b"half a block")
    old = time.time() - 3600
    os.utime(ours, (old, old))
    os.utime(theirs, (old, old))
    with tier(tmp_path) as t:
        assert len(t) == 0 and t.stats()["foreign"] == 0
    # ours is gone; a young one may be another live process's write; another identity's is not ours to delete
    assert not ours.exists() and fresh.exists() and theirs.exists()


def test_unwritable_directory_names_the_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="kv-offloading-dir"):
        tier(blocker / "kv")


@pytest.mark.parametrize("field, value", [("limit_bytes", 0), ("block_bytes", -1), ("max_pending_writes", 0)])
def test_bad_arguments_name_the_field(tmp_path, field, value):
    args = {"limit_bytes": FILE, "block_bytes": BLOCK, "max_pending_writes": 4}
    args[field] = value
    with pytest.raises(ValueError, match=field):
        DiskKVTier(tmp_path, args["limit_bytes"], ID_A, args["block_bytes"],
                   max_pending_writes=args["max_pending_writes"])
    with pytest.raises(ValueError, match="identity"):
        DiskKVTier(tmp_path, FILE, b"short", BLOCK)


def test_closed_tier_drops_writes(tmp_path):
    t = tier(tmp_path)
    t.close()
    t.close()
    assert not t.write(h(1), payload(1)) and t.stats()["dropped"] == 1


# -- the identity --------------------------------------------------------------------------------------------


def fake_spec(**changes) -> SimpleNamespace:
    spec = SimpleNamespace(
        architecture="LlamaForCausalLM",
        model_config={"hidden_size": 64, "num_layers": 2},
        build_config={"dtype": "float32", "kv_block_size": 16, "kv_cache_dtype": "float32",
                      "max_batch_size": 8, "max_seq_len": 256},
        target={"device_type": "cpu"},
        files={"rank0.safetensors": FileEntry(size=10, sha256="a" * 64),
               "tokenizer/tokenizer.json": FileEntry(size=5, sha256="b" * 64)},
    )
    for key, value in changes.items():
        setattr(spec, key, value)
    return spec


def ident(spec, **changes) -> bytes:
    args = {"kv_cache_dtype": "float32", "block_size": 16, "tp_size": 2, "tp_rank": 0, "block_bytes": 4096}
    args.update(changes)
    return kv_identity(spec, **args)


def test_identity_changes_with_what_changes_the_kv():
    base = ident(fake_spec())
    assert len(base) == 32 and base == ident(fake_spec())
    other_weights = {**fake_spec().files, "rank0.safetensors": FileEntry(size=10, sha256="c" * 64)}
    differing = [
        ident(fake_spec(files=other_weights)),
        ident(fake_spec(), kv_cache_dtype="fp8"),
        ident(fake_spec(), block_size=32),
        ident(fake_spec(), tp_rank=1),
        ident(fake_spec(), tp_size=4),
        ident(fake_spec(), block_bytes=8192),
        ident(fake_spec(model_config={"hidden_size": 128, "num_layers": 2})),
        ident(fake_spec(build_config={**fake_spec().build_config, "kv_cache_dtype": "int8"})),
    ]
    assert len({base, *differing}) == len(differing) + 1


def test_identity_ignores_what_does_not_change_the_kv():
    base = ident(fake_spec())
    other_tokenizer = {**fake_spec().files, "tokenizer/tokenizer.json": FileEntry(size=6, sha256="d" * 64)}
    assert ident(fake_spec(files=other_tokenizer)) == base
    assert ident(fake_spec(build_config={**fake_spec().build_config, "max_batch_size": 64})) == base
    assert ident(fake_spec(target={"device_type": "cpu", "torch_version": "9.9"})) == base


def test_identity_of_a_real_engine_spec_and_bad_arguments(tmp_path):
    spec = EngineSpec(engine_dir=tmp_path, format_version=1, kiln_version="0", architecture="LlamaForCausalLM",
                      model_config={"hidden_size": 64}, build_config={"dtype": "float32"},
                      mapping={"tp_size": 1, "num_ranks": 1}, target={"device_type": "cpu"},
                      files={"rank0.safetensors": FileEntry(size=1, sha256="e" * 64)})
    assert len(kv_identity(spec, kv_cache_dtype="float32", block_size=16, tp_size=1, tp_rank=0,
                           block_bytes=64)) == 32
    with pytest.raises(ValueError, match="tp_rank"):
        ident(fake_spec(), tp_rank=2)
    with pytest.raises(ValueError, match="block_size"):
        ident(fake_spec(), block_size=0)
