import hashlib
import json

import pytest
import torch

from kiln import __version__
from kiln.builder.safetensors_writer import TensorSpec, write_safetensors_streaming
from kiln.engine_format import (
    ENGINE_FORMAT_VERSION,
    ENGINE_JSON,
    EngineError,
    EngineSpec,
    FileEntry,
    file_entry,
    load_engine_spec,
    write_engine_json,
)

MODEL_CONFIG = {"hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 16}
BUILD_CONFIG = {
    "dtype": "float32",
    "max_batch_size": 4,
    "max_num_tokens": 64,
    "max_seq_len": 32,
    "kv_block_size": 16,
    "quantization": None,
    "kv_cache_dtype": "float32",
}
TARGET = {
    "device_type": "cpu",
    "gpu_name": None,
    "compute_capability": None,
    "torch_version": torch.__version__,
    "triton_version": None,
    "kernel_settings": {},
}


def make_engine(engine_dir, *, num_ranks=1, tokenizer=True):
    """A small valid engine: rank files written by the streaming writer, plus tokenizer files."""
    engine_dir.mkdir(exist_ok=True)
    files = {}
    for rank in range(num_ranks):
        spec = TensorSpec("w", torch.float32, (4, 4))
        written = write_safetensors_streaming(
            engine_dir / f"rank{rank}.safetensors", [spec], lambda s: torch.ones(4, 4)
        )
        files[f"rank{rank}.safetensors"] = FileEntry(written.size, written.sha256)
    if tokenizer:
        (engine_dir / "tokenizer").mkdir()
        (engine_dir / "tokenizer" / "tokenizer.json").write_text('{"model": {}}')
        files["tokenizer/tokenizer.json"] = file_entry(engine_dir / "tokenizer" / "tokenizer.json")
    write_engine_json(
        engine_dir,
        architecture="LlamaForCausalLM",
        model_config=MODEL_CONFIG,
        build_config=BUILD_CONFIG,
        mapping={"tp_size": num_ranks, "num_ranks": num_ranks},
        target=TARGET,
        files=files,
        kiln_version=__version__,
    )
    return engine_dir


@pytest.fixture
def engine(tmp_path):
    return make_engine(tmp_path / "engine")


def edit_json(engine_dir, change):
    path = engine_dir / ENGINE_JSON
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def engine_error(engine_dir, **kwargs) -> str:
    with pytest.raises(EngineError) as info:
        load_engine_spec(engine_dir, **kwargs)
    return str(info.value)


# -- good engines -------------------------------------------------------------------------------------


def test_round_trip(engine):
    spec = load_engine_spec(engine, verify_checksums=True)
    assert isinstance(spec, EngineSpec)
    assert spec.engine_dir == engine
    assert spec.format_version == 1  # full precision: what older kilns read too
    assert spec.kiln_version == __version__
    assert spec.architecture == "LlamaForCausalLM"
    assert spec.model_config == MODEL_CONFIG
    assert spec.build_config == BUILD_CONFIG
    assert spec.mapping == {"tp_size": 1, "num_ranks": 1}
    assert spec.target == TARGET
    assert set(spec.files) == {"rank0.safetensors", "tokenizer/tokenizer.json"}
    assert spec.files["rank0.safetensors"] == file_entry(engine / "rank0.safetensors")
    assert spec.rank_file(0) == engine / "rank0.safetensors"
    assert spec.tokenizer_dir == engine / "tokenizer"
    with pytest.raises(ValueError, match="rank 1 is out of range"):
        spec.rank_file(1)


def test_engine_without_tokenizer_has_no_tokenizer_dir(tmp_path):
    spec = load_engine_spec(make_engine(tmp_path / "e", tokenizer=False))
    assert spec.tokenizer_dir is None


def test_several_ranks(tmp_path):
    spec = load_engine_spec(make_engine(tmp_path / "e", num_ranks=2))
    assert spec.rank_file(1) == tmp_path / "e" / "rank1.safetensors"


def test_file_entry_matches_hashlib(tmp_path):
    path = tmp_path / "blob"
    data = bytes(range(256)) * 9000  # > 1 MiB, so several chunks
    path.write_bytes(data)
    assert file_entry(path) == FileEntry(len(data), hashlib.sha256(data).hexdigest())


def test_engine_json_is_stable_pretty_and_ordered(tmp_path):
    first = (make_engine(tmp_path / "a") / ENGINE_JSON).read_text()
    second = (make_engine(tmp_path / "b") / ENGINE_JSON).read_text()
    assert first == second
    assert first.startswith('{\n  "format_version": 1,\n  "kiln_version"')
    assert list(json.loads(first)) == [
        "format_version",
        "kiln_version",
        "architecture",
        "model_config",
        "build_config",
        "mapping",
        "target",
        "files",
    ]
    assert [p.name for p in (tmp_path / "a").iterdir() if p.suffix == ".tmp"] == []


def test_write_engine_json_rejects_bad_input(tmp_path):
    kwargs = dict(
        architecture="X",
        model_config={},
        build_config={},
        mapping={"tp_size": 1, "num_ranks": 1},
        target={},
        kiln_version="0",
    )
    with pytest.raises(ValueError, match="relative posix path"):
        write_engine_json(tmp_path, files={"../escape": FileEntry(1, "0" * 64)}, **kwargs)
    with pytest.raises(TypeError, match="FileEntry"):
        write_engine_json(tmp_path, files={"rank0.safetensors": (1, "0" * 64)}, **kwargs)
    with pytest.raises(TypeError, match="plain JSON"):
        write_engine_json(tmp_path, files={}, **{**kwargs, "model_config": {"x": object()}})
    assert not (tmp_path / ENGINE_JSON).exists()


# -- broken engines -----------------------------------------------------------------------------------


def test_missing_engine_dir(tmp_path):
    message = engine_error(tmp_path / "nope")
    assert (
        "does not exist" in message
        and "kiln build --checkpoint" in message
        and str(tmp_path / "nope") in message
    )


def test_engine_dir_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    assert "does not exist" in engine_error(tmp_path / "file")


def test_missing_engine_json(engine):
    (engine / ENGINE_JSON).unlink()
    message = engine_error(engine)
    assert "no engine.json" in message and "kiln build" in message


def test_unreadable_engine_json(engine):
    (engine / ENGINE_JSON).write_bytes(b"\xff\xfe\x00garbage")
    assert "cannot read" in engine_error(engine)


def test_invalid_json_names_the_position(engine):
    (engine / ENGINE_JSON).write_text('{\n  "format_version": 1,\n  oops\n}')
    message = engine_error(engine)
    assert "not valid JSON" in message and "line 3 column 3" in message


def test_json_that_is_not_an_object(engine):
    (engine / ENGINE_JSON).write_text("[1, 2, 3]")
    assert "must hold a JSON object, found list" in engine_error(engine)


@pytest.mark.parametrize(
    "field", ["kiln_version", "architecture", "model_config", "build_config", "mapping", "target", "files"]
)
def test_missing_field_is_named(engine, field):
    edit_json(engine, lambda d: d.pop(field))
    message = engine_error(engine)
    assert f"required field '{field}' is missing" in message


@pytest.mark.parametrize(
    "field, value",
    [("architecture", 3), ("model_config", []), ("files", "all"), ("mapping", None), ("kiln_version", True)],
)
def test_field_of_wrong_type_is_named(engine, field, value):
    edit_json(engine, lambda d: d.__setitem__(field, value))
    assert f"field '{field}' must be" in engine_error(engine)


@pytest.mark.parametrize("value", [None, "1", 1.0, True])
def test_bad_format_version(engine, value):
    edit_json(engine, lambda d: d.__setitem__("format_version", value))
    assert "'format_version' must be an integer" in engine_error(engine)


def test_format_version_zero(engine):
    edit_json(engine, lambda d: d.__setitem__("format_version", 0))
    assert "format version 0 is invalid" in engine_error(engine)


def test_newer_format_version(engine):
    def newer(document):
        document["format_version"] = ENGINE_FORMAT_VERSION + 1
        document["kiln_version"] = "9.9.9"
        del document["files"]  # a newer format may have changed fields: the version is reported first

    edit_json(engine, newer)
    message = engine_error(engine)
    assert (
        f"engine format version {ENGINE_FORMAT_VERSION + 1} was written by kiln 9.9.9; this kiln {__version__} "
        f"reads versions up to {ENGINE_FORMAT_VERSION}: "
        "upgrade kiln or rebuild the engine"
    ) in message


@pytest.mark.parametrize(
    "mapping", [{"tp_size": 1}, {"tp_size": 1, "num_ranks": 0}, {"tp_size": "1", "num_ranks": 1}]
)
def test_bad_mapping(engine, mapping):
    edit_json(engine, lambda d: d.__setitem__("mapping", mapping))
    assert "field 'mapping." in engine_error(engine)


def test_mapping_with_more_ranks_than_rank_files(engine):
    edit_json(engine, lambda d: d.__setitem__("mapping", {"tp_size": 2, "num_ranks": 2}))
    assert "lists no rank1.safetensors" in engine_error(engine)


@pytest.mark.parametrize(
    "entry", [{"size": 1}, {"size": -1, "sha256": "0" * 64}, {"size": 1, "sha256": "xyz"}, [1, "0" * 64]]
)
def test_malformed_manifest_entry(engine, entry):
    edit_json(engine, lambda d: d["files"].__setitem__("tokenizer/tokenizer.json", entry))
    assert "'tokenizer/tokenizer.json'" in engine_error(engine)


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside", "tokenizer/../../x", "engine.json"])
def test_manifest_paths_must_stay_inside_the_engine(engine, path):
    edit_json(engine, lambda d: d["files"].__setitem__(path, {"size": 0, "sha256": "0" * 64}))
    assert "relative posix path" in engine_error(engine)


def test_missing_manifest_file(engine):
    (engine / "tokenizer" / "tokenizer.json").unlink()
    message = engine_error(engine)
    assert "tokenizer/tokenizer.json is listed in engine.json but missing" in message
    assert "rebuild the engine" in message


def test_truncated_weight_file(engine):
    path = engine / "rank0.safetensors"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-7])
    message = engine_error(engine)
    assert f"rank0.safetensors is {size - 7} bytes, the manifest says {size} bytes" in message
    assert "truncated or modified" in message and "rebuild the engine" in message


def test_changed_byte_is_caught_unless_checksums_are_skipped(engine):
    path = engine / "rank0.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    load_engine_spec(engine, verify_checksums=False)  # sizes match: the cheap check passes
    message = engine_error(engine)
    assert "rank0.safetensors has sha256 that differs" in message


def test_all_file_problems_are_reported_together(engine):
    (engine / "tokenizer" / "tokenizer.json").unlink()
    (engine / "rank0.safetensors").write_bytes(b"")
    message = engine_error(engine)
    assert "tokenizer/tokenizer.json" in message and "rank0.safetensors is 0 bytes" in message


def test_extra_files_are_ignored(engine):
    (engine / "notes.txt").write_text("mine")
    load_engine_spec(engine, verify_checksums=True)
