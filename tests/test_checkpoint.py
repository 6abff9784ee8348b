import json

import pytest
import torch
from safetensors.torch import save_file

from kiln.checkpoints.reader import CheckpointError, CheckpointReader

torch.manual_seed(0)
TENSORS = {
    "model.embed_tokens.weight": torch.randn(8, 4).to(torch.bfloat16),
    "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, dtype=torch.float16),
    "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4),
    "model.norm.weight": torch.ones(4),
    "lm_head.weight": torch.randn(8, 4),
    "scale_fp8": torch.randn(3).to(torch.float8_e4m3fn),
    "positions": torch.arange(5, dtype=torch.int64),
}
SHARD_1 = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "scale_fp8"]
SHARD_2 = [n for n in TENSORS if n not in SHARD_1]


def _subset(names):
    return {n: TENSORS[n] for n in names}


def _write_index(path, shard_of):
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": shard_of}))


def make_single_safetensors(d):
    save_file(TENSORS, d / "model.safetensors")


def make_sharded_safetensors(d):
    names = {"model-00001-of-00002.safetensors": SHARD_1, "model-00002-of-00002.safetensors": SHARD_2}
    for file, shard in names.items():
        save_file(_subset(shard), d / file)
    _write_index(d / "model.safetensors.index.json", {n: f for f, shard in names.items() for n in shard})


def make_unindexed_safetensors(d):
    save_file(_subset(SHARD_1), d / "a.safetensors")
    save_file(_subset(SHARD_2), d / "b.safetensors")


def make_single_bin(d):
    torch.save(TENSORS, d / "pytorch_model.bin")


def make_legacy_bin(d):
    # Pre-1.6 pickles cannot be memory-mapped: the reader must fall back to a plain load.
    # (torch itself cannot round-trip float8 through the legacy format.)
    tensors = {n: t for n, t in TENSORS.items() if t.dtype != torch.float8_e4m3fn}
    torch.save(tensors, d / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    return tensors


def make_sharded_bin(d):
    names = {"pytorch_model-00001-of-00002.bin": SHARD_1, "pytorch_model-00002-of-00002.bin": SHARD_2}
    for file, shard in names.items():
        torch.save(_subset(shard), d / file)
    _write_index(d / "pytorch_model.bin.index.json", {n: f for f, shard in names.items() for n in shard})


def make_unindexed_bin(d):
    torch.save(_subset(SHARD_1), d / "x.bin")
    torch.save(_subset(SHARD_2), d / "y.bin")
    (d / "training_args.bin").write_bytes(b"not weights")


LAYOUTS = {
    "single_safetensors": (make_single_safetensors, "safetensors"),
    "sharded_safetensors": (make_sharded_safetensors, "safetensors"),
    "unindexed_safetensors": (make_unindexed_safetensors, "safetensors"),
    "single_bin": (make_single_bin, "bin"),
    "legacy_bin": (make_legacy_bin, "bin"),
    "sharded_bin": (make_sharded_bin, "bin"),
    "unindexed_bin": (make_unindexed_bin, "bin"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_reads_every_tensor_exactly(tmp_path, layout):
    make, expected_format = LAYOUTS[layout]
    tensors = make(tmp_path) or TENSORS
    (tmp_path / "config.json").write_text("{}")
    with CheckpointReader(tmp_path) as reader:
        assert reader.format == expected_format
        assert reader.names() == sorted(tensors)
        for name, expected in tensors.items():
            assert reader.shape(name) == tuple(expected.shape)
            assert reader.dtype(name) == expected.dtype
            got = reader.get(name)
            assert got.dtype == expected.dtype and got.device.type == "cpu"
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name


class _NoLoadHandle:
    """A safe_open handle that fails if any tensor's data is read."""

    def __init__(self, handle):
        self._handle = handle

    def keys(self):
        return self._handle.keys()

    def get_slice(self, name):
        return self._handle.get_slice(name)

    def get_tensor(self, name):
        raise AssertionError(f"tensor data of {name!r} was loaded")


def test_safetensors_shape_and_dtype_do_not_load_the_tensor(tmp_path, monkeypatch):
    import kiln.checkpoints.reader as checkpoint

    real_safe_open = checkpoint.safe_open
    monkeypatch.setattr(checkpoint, "safe_open", lambda *a, **k: _NoLoadHandle(real_safe_open(*a, **k)))
    make_sharded_safetensors(tmp_path)
    with CheckpointReader(tmp_path) as reader:
        for name, expected in TENSORS.items():
            assert reader.shape(name) == tuple(expected.shape)
            assert reader.dtype(name) == expected.dtype
        with pytest.raises(AssertionError, match="was loaded"):
            reader.get("lm_head.weight")


def test_index_takes_precedence_over_stray_files(tmp_path):
    make_sharded_safetensors(tmp_path)
    save_file({"stray": torch.ones(1)}, tmp_path / "consolidated.safetensors")
    torch.save({"bin_only": torch.ones(1)}, tmp_path / "pytorch_model.bin")
    with CheckpointReader(tmp_path) as reader:
        assert reader.names() == sorted(TENSORS)


def test_safetensors_preferred_over_bin(tmp_path):
    make_single_bin(tmp_path)
    save_file({"only.in.safetensors": torch.ones(2)}, tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path) as reader:
        assert reader.names() == ["only.in.safetensors"]


def test_missing_tensor_names_tensor_and_checkpoint(tmp_path):
    make_single_safetensors(tmp_path)
    with CheckpointReader(tmp_path) as reader:
        for query in (reader.get, reader.shape, reader.dtype):
            with pytest.raises(CheckpointError, match=r"'no\.such\.weight'.*" + str(tmp_path)):
                query("no.such.weight")


def test_empty_directory_lists_what_was_looked_for(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message
    for looked_for in ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin", "*.bin"):
        assert looked_for in message


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nope")


@pytest.mark.parametrize(
    "make, index",
    [
        (make_sharded_safetensors, "model.safetensors.index.json"),
        (make_sharded_bin, "pytorch_model.bin.index.json"),
    ],
)
def test_index_pointing_to_missing_shard_names_the_shard(tmp_path, make, index):
    make(tmp_path)
    shard = json.loads((tmp_path / index).read_text())["weight_map"]["lm_head.weight"]
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        CheckpointReader(tmp_path)


def test_index_claiming_a_tensor_its_shard_lacks(tmp_path):
    make_sharded_safetensors(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    _write_index(tmp_path / "model.safetensors.index.json", index["weight_map"])
    with CheckpointReader(tmp_path) as reader:
        with pytest.raises(CheckpointError, match="'ghost'.*model-00001-of-00002.safetensors"):
            reader.get("ghost")


@pytest.mark.parametrize("content", ["{not json", json.dumps({"metadata": {}}), json.dumps([1, 2])])
def test_bad_index_names_the_index(tmp_path, content):
    make_sharded_safetensors(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(content)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        CheckpointReader(tmp_path)


def test_truncated_safetensors_names_the_file(tmp_path):
    make_single_safetensors(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="model.safetensors.*corrupt"):
        CheckpointReader(tmp_path)


def test_corrupt_shard_is_reported_on_first_use(tmp_path):
    make_sharded_safetensors(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"garbage!")
    with CheckpointReader(tmp_path) as reader:
        assert reader.shape("model.embed_tokens.weight") == (8, 4)  # the good shard still reads
        with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
            reader.get("lm_head.weight")


def test_corrupt_bin_names_the_file(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"junkjunkjunk")
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        CheckpointReader(tmp_path)


def test_bin_that_is_not_a_state_dict(tmp_path):
    torch.save([torch.ones(1)], tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*expected a dict"):
        CheckpointReader(tmp_path)


def test_same_tensor_in_two_unindexed_files(tmp_path):
    save_file({"w": torch.ones(1)}, tmp_path / "a.safetensors")
    save_file({"w": torch.zeros(1)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match="'w'.*a.safetensors.*b.safetensors"):
        CheckpointReader(tmp_path)


def test_closed_reader_refuses_reads(tmp_path):
    make_single_safetensors(tmp_path)
    reader = CheckpointReader(tmp_path)
    reader.close()
    with pytest.raises(CheckpointError, match="closed"):
        reader.get("lm_head.weight")
