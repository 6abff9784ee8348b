"""Startup hashes the engine files in the background while it loads, and hands the engine out only after
every file matched the manifest; the weight reader used on GPUs gives the tensors safetensors gives."""

from __future__ import annotations

import json
import logging
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.engine_format import EngineError
from kiln.engine_format import verify as verify_module
from kiln.engine_format.spec import load_engine_spec
from kiln.engine_format.stamps import stamp_file
from kiln.runtime import LLM
from kiln.runtime.engine import factory
from kiln.runtime.worker.weight_reader import read_weights

MISMATCH = r"does not match its manifest: rank0\.safetensors has sha256 that differs from the manifest's"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Stamps go to a private cache: every test starts as a fresh machine does."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def engine(tiny_code_engine, tmp_path):
    return Path(shutil.copytree(tiny_code_engine, tmp_path / "engine"))


@pytest.fixture
def events(monkeypatch):
    """What happened, in order: "executor" when the network is loaded, "hashed NAME" as each hash ends."""
    seen: list[str] = []
    real_hash, real_executor = verify_module.file_sha256, factory.create_executor

    def hash_file(path, stop=None):
        digest = real_hash(path, stop)
        seen.append(f"hashed {Path(path).name}")
        return digest

    def create_executor(*args, **kwargs):
        executor = real_executor(*args, **kwargs)
        seen.append("executor")
        return executor

    monkeypatch.setattr(verify_module, "file_sha256", hash_file)
    monkeypatch.setattr(factory, "create_executor", create_executor)
    return seen


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_weights_load_while_hashing_and_the_engine_waits_for_it(engine, events, monkeypatch):
    """The weights' hash cannot finish before the network is loaded (it waits for that), so a startup that
    hashed first would time out here; the engine still comes back only after the hash."""
    loaded = threading.Event()
    real_hash = verify_module.file_sha256

    def hash_after_loading(path, stop=None):
        if Path(path).name == "rank0.safetensors":
            assert loaded.wait(60), "the weights were not loaded while rank0.safetensors was being hashed"
        return real_hash(path, stop)

    monkeypatch.setattr(verify_module, "file_sha256", hash_after_loading)
    real_executor = factory.create_executor

    def create_executor(*args, **kwargs):
        executor = real_executor(*args, **kwargs)
        loaded.set()
        return executor

    monkeypatch.setattr(factory, "create_executor", create_executor)
    llm = LLM(engine)
    events.append("returned")
    assert events.index("hashed rank0.safetensors") < events.index("returned")
    assert len(llm.generate([[5, 6, 7]])[0].token_ids) > 0


def test_stamps_are_written_after_an_overlapped_verify(engine, events):
    LLM(engine)
    assert stamp_file(engine).is_file()
    assert sorted(e for e in events if e.startswith("hashed")) == sorted(
        f"hashed {n}" for n in ("rank0.safetensors", "tokenizer.json", "tokenizer_config.json",
                                "generation_config.json"))
    events.clear()
    LLM(engine)  # the second start trusts the stamps: nothing is read
    assert events == ["executor"]


def test_a_tampered_weight_file_is_refused_and_the_loaded_engine_released(engine, monkeypatch):
    released = []
    real_release = factory.release_executor
    monkeypatch.setattr(factory, "release_executor", lambda ex, spec=None: (released.append(ex), real_release(ex, spec)))
    flip_byte(engine / "rank0.safetensors", -1)  # loads fine: only the hash can tell
    with pytest.raises(EngineError, match=MISMATCH) as info:
        LLM(engine)
    assert str(info.value).endswith("or copy it again completely")
    assert len(released) == 1
    assert not stamp_file(engine).exists() or "rank0" not in stamp_file(engine).read_text()


def test_a_load_failure_that_a_damaged_file_explains_names_the_manifest(engine):
    flip_byte(engine / "rank0.safetensors", 12)  # inside the JSON header: loading fails first
    with pytest.raises(EngineError, match=MISMATCH) as info:
        LLM(engine)
    assert info.value.__cause__ is not None  # the loader's own error stays attached


def test_an_interrupt_stops_the_hashing_and_records_nothing(engine, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(factory, "create_executor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        LLM(engine)
    assert not stamp_file(engine).exists()


def test_the_startup_log_shows_the_verify_stage(engine, caplog):
    with caplog.at_level(logging.INFO, logger="kiln.runtime"):
        LLM(engine)
        LLM(engine)
        LLM(engine, verify_checksums=False)
    ready = [r.getMessage() for r in caplog.records if "ready in" in r.getMessage()]
    assert "verify (overlapped)" in ready[0] and "sha256 of 4 file(s)" in ready[0]
    assert "verify (overlapped) 0.00s (4 file(s) trusted by stamp)" in ready[1]
    assert "verify 0.00s (sha256 skipped: verify_checksums=False)" in ready[2]


def test_verification_waits_once_and_a_cancelled_hash_stops(engine, events):
    files = load_engine_spec(engine, verify_checksums=False).files
    verification = verify_module.start_verification(engine, files)
    assert verification.wait() == [] and verification.done
    hashed = len(events)
    assert verification.wait() == [] and len(events) == hashed  # the same answer, nothing hashed again
    stop = threading.Event()
    assert verify_module.file_sha256(engine / "rank0.safetensors", stop) == files["rank0.safetensors"].sha256
    stop.set()
    assert verify_module.file_sha256(engine / "rank0.safetensors", stop) is None


# -- the weight reader ------------------------------------------------------------------------------------


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(37, 19, generator=g).to(torch.bfloat16),
        "b.odd_bytes": torch.randint(-128, 127, (7, 3), dtype=torch.int8, generator=g),  # 21 bytes: unaligned after
        "c.fp8": torch.randn(5, 8, generator=g).to(torch.float8_e4m3fn),
        "d.scale": torch.tensor(0.25),  # 0-dim
        "e.empty": torch.empty(0, 4),
        "f.mask": torch.rand(13, generator=g) > 0.5,
        "g.big": torch.randn(300, 41, generator=g),
        "h.int64": torch.arange(9, dtype=torch.int64),
    }


@pytest.mark.parametrize("chunk_bytes, threads", [(1 << 20, 1), (7, 1), (100, 3), (4096, 2), (1, 4)])
def test_read_weights_gives_the_tensors_load_file_gives(tmp_path, chunk_bytes, threads):
    path = tmp_path / "w.safetensors"
    save_file(mixed_tensors(), str(path), metadata={"format": "pt"})
    expected = load_file(str(path))
    got = read_weights(path, torch.device("cpu"), chunk_bytes=chunk_bytes, threads=threads)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)) if tensor.dim() else \
            got[name].item() == tensor.item()
    # each tensor owns its memory, as load_file's copies to a device do
    assert len({t.untyped_storage().data_ptr() for t in got.values() if t.numel()}) == \
        sum(1 for t in got.values() if t.numel())


def test_read_weights_reads_a_built_engine(engine):
    path = engine / "rank0.safetensors"
    expected = load_file(str(path))
    got = read_weights(path, torch.device("cpu"), chunk_bytes=1000, threads=2)
    assert sorted(got) == sorted(expected) and all(torch.equal(got[n], expected[n]) for n in expected)


def write_raw(path: Path, header: object, data: bytes, header_bytes: bytes | None = None) -> Path:
    body = header_bytes if header_bytes is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


@pytest.mark.parametrize("header, data, message", [
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "the tensors end at byte"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "needs 8"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "must cover the data back to back"),
    ({"x": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "dtype 'Q4' is not one of"),
    ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", "not a list of non-negative integers"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "is not [begin, end]"),
    ({"x": "F32"}, b"", "its header entry is not an object"),
    ([1, 2], b"", "not an object"),
])
def test_read_weights_refuses_a_malformed_file_before_allocating(tmp_path, header, data, message):
    path = write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_weights(path, torch.device("cpu"))


def test_read_weights_refuses_a_bad_header(tmp_path):
    with pytest.raises(ValueError, match="not valid JSON"):
        read_weights(write_raw(tmp_path / "a", None, b"", header_bytes=b"{nope"), torch.device("cpu"))
    (tmp_path / "b").write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match="header length 1099511627776 exceeds the file"):
        read_weights(tmp_path / "b", torch.device("cpu"))
    (tmp_path / "c").write_bytes(b"\1\2")
    with pytest.raises(ValueError, match="too short for a safetensors header"):
        read_weights(tmp_path / "c", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chunk_bytes, threads", [(1 << 25, 4), (100, 3), (4096, 1)])
def test_gpu_read_weights_gives_the_tensors_load_file_gives(tmp_path, chunk_bytes, threads):
    """Through pinned chunks on side streams, from threads whose own current device is GPU 0."""
    path = tmp_path / "w.safetensors"
    save_file(mixed_tensors(), str(path))
    expected = load_file(str(path))
    device = torch.device("cuda", torch.cuda.device_count() - 1)  # the last GPU: not the threads' default
    with torch.cuda.device(device):
        got = read_weights(path, torch.device("cuda"), chunk_bytes=chunk_bytes, threads=threads)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].device == device and got[name].dtype == tensor.dtype, name
        assert torch.equal(_cpu_bytes(got[name]), _cpu_bytes(tensor)), name


def _cpu_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cpu().reshape(-1).view(torch.uint8)
