import hashlib
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kiln.builder.safetensors_writer import TensorSpec, WrittenFile, write_safetensors_streaming


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=torch.int64
    ).to(dtype)


TENSORS = {
    "f32": _random(torch.float32, (3, 5), 0),
    "f16": _random(torch.float16, (7,), 1),
    "bf16": _random(torch.bfloat16, (4, 2, 3), 2),
    "i8": _random(torch.int8, (9,), 3),
    "u8": _random(torch.uint8, (2, 2), 4),
    "i32": _random(torch.int32, (5,), 5),
    "i64": _random(torch.int64, (3,), 6),
    "fp8": _random(torch.float8_e4m3fn, (6,), 7),
    "bool": _random(torch.bool, (5,), 8),
    "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
    "empty": torch.zeros(0, 4),
}


def _write(path, tensors, **kwargs) -> WrittenFile:
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    return write_safetensors_streaming(path, specs, lambda spec: tensors[spec.name], **kwargs)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def test_round_trip_is_bit_exact_for_every_dtype(tmp_path):
    path = tmp_path / "rank0.safetensors"
    written = _write(path, TENSORS, metadata={"format": "pt", "note": "ünïcode"})
    assert written.path == path
    loaded = load_file(path)
    assert loaded.keys() == TENSORS.keys()
    for name, tensor in TENSORS.items():
        assert _bits_equal(loaded[name], tensor), name
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "ünïcode"}
        for name, tensor in TENSORS.items():
            assert _bits_equal(f.get_tensor(name), tensor), name


def test_size_and_sha256_describe_the_whole_file(tmp_path):
    path = tmp_path / "w.safetensors"
    written = _write(path, TENSORS)
    data = path.read_bytes()
    assert written.size == len(data)
    assert written.sha256 == hashlib.sha256(data).hexdigest()


def test_header_is_padded_to_eight_bytes_and_data_follows_in_spec_order(tmp_path):
    path = tmp_path / "w.safetensors"
    _write(path, {"b": torch.ones(3), "a": torch.ones(1, dtype=torch.int8)})
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    assert header_len % 8 == 0
    header = json.loads(data[8 : 8 + header_len])
    assert header["b"]["data_offsets"] == [0, 12]
    assert header["a"]["data_offsets"] == [12, 13]
    assert "__metadata__" not in header


def test_non_contiguous_and_view_tensors_write_only_their_elements(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"t": base.t(), "slice": base[1:3, 2:4], "row": base[2]}
    path = tmp_path / "w.safetensors"
    _write(path, tensors, progress=True, desc="test")
    loaded = load_file(path)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)


def test_produce_is_called_once_per_spec_in_order(tmp_path):
    calls = []

    def produce(spec):
        calls.append(spec.name)
        return torch.full(spec.shape, float(len(calls)))

    specs = [TensorSpec(n, torch.float32, (2,)) for n in ("z", "y", "x")]
    write_safetensors_streaming(tmp_path / "w.safetensors", specs, produce)
    assert calls == ["z", "y", "x"]


@pytest.mark.parametrize(
    "produced, message",
    [
        (torch.zeros(2, 3, dtype=torch.float16), "dtype torch.float16"),
        (torch.zeros(3, 2), r"shape \(3, 2\)"),
        ("not a tensor", "expected torch.Tensor"),
    ],
)
def test_mismatched_tensor_is_rejected_and_leaves_no_file(tmp_path, produced, message):
    path = tmp_path / "w.safetensors"
    specs = [TensorSpec("good", torch.float32, (1,)), TensorSpec("layer.w", torch.float32, (2, 3))]
    produce = {"good": torch.ones(1), "layer.w": produced}
    with pytest.raises(ValueError, match=message) as info:
        write_safetensors_streaming(path, specs, lambda s: produce[s.name])
    assert "'layer.w'" in str(info.value)
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_crash_in_produce_leaves_no_file(tmp_path):
    def produce(spec):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_safetensors_streaming(
            tmp_path / "w.safetensors", [TensorSpec("a", torch.float32, (1,))], produce
        )
    assert list(tmp_path.iterdir()) == []


def test_invalid_specs_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="twice"):
        write_safetensors_streaming(
            tmp_path / "d.safetensors",
            [TensorSpec("a", torch.float32, (1,)), TensorSpec("a", torch.float32, (1,))],
            lambda s: torch.ones(1),
        )
    with pytest.raises(ValueError, match="complex64"):
        write_safetensors_streaming(
            tmp_path / "c.safetensors", [TensorSpec("c", torch.complex64, (1,))], lambda s: torch.ones(1)
        )
    with pytest.raises(ValueError, match="metadata"):
        _write(tmp_path / "m.safetensors", {"a": torch.ones(1)}, metadata={"n": 1})
