"""Engine files are trusted only as far as they prove: weights verified against the manifest by default
(hashed once, then trusted by stamp while unchanged), lying engine.json / tokenizer files fail in one
line naming file, key and value, and a build replaces only a directory that is a kiln engine."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest

from kiln.builder.build import BuildError, _check_output, build_engine
from kiln.builder.build_config import BuildConfig
from kiln.cli import main
from kiln.engine_format import EngineError, file_entry
from kiln.engine_format import verify as verify_module
from kiln.engine_format.staging import staged_directory
from kiln.engine_format.stamps import stamp_file
from kiln.runtime import LLM
from kiln.runtime.worker.engine_loader import load_engine_info

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Stamps go to a private cache, never the real home's."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def engine(tiny_code_engine, tmp_path):
    return Path(shutil.copytree(tiny_code_engine, tmp_path / "engine"))


@pytest.fixture
def hashes(monkeypatch):
    """The paths hashed while verifying, in order."""
    hashed: list[str] = []

    real = verify_module.file_sha256

    def counting_file_sha256(path, stop=None):
        hashed.append(Path(path).name)
        return real(path, stop)

    monkeypatch.setattr(verify_module, "file_sha256", counting_file_sha256)
    return hashed


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_engine_json(engine: Path, change) -> None:
    doc = json.loads((engine / "engine.json").read_text())
    change(doc)
    (engine / "engine.json").write_text(json.dumps(doc))


def rewrite_listed_file(engine: Path, rel_path: str, text: str) -> None:
    """Replaces a file and its manifest entry: an engine that is consistent but lies in the file itself."""
    (engine / rel_path).write_text(text)
    entry = file_entry(engine / rel_path)
    edit_engine_json(engine, lambda d: d["files"].__setitem__(rel_path, {"size": entry.size, "sha256": entry.sha256}))


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("kiln generate: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


# -- weights verified by default ------------------------------------------------------------------------


def test_flipped_byte_fails_by_default_and_loads_when_skipped(engine):
    flip_last_byte(engine / "rank0.safetensors")
    with pytest.raises(EngineError, match=r"does not match its manifest: rank0\.safetensors has sha256 that differs"):
        LLM(engine)
    LLM(engine, verify_checksums=False)


def test_all_zero_sha256_in_the_manifest_fails(engine):
    LLM(engine)  # a stamp for the true hash must not vouch for another expected hash
    edit_engine_json(engine, lambda d: d["files"]["rank0.safetensors"].__setitem__("sha256", "0" * 64))
    with pytest.raises(EngineError, match=r"does not match its manifest: rank0\.safetensors has sha256"):
        LLM(engine)


def test_second_load_of_an_unchanged_engine_hashes_nothing(engine, hashes, cache_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kiln.engine_format"):
        load_engine_info(engine)
        assert sorted(hashes) == sorted(["rank0.safetensors", "tokenizer.json", "tokenizer_config.json",
                                         "generation_config.json"])
        assert "(4 hashed, 0 trusted by stamp)" in caplog.text
        hashes.clear()
        caplog.clear()
        load_engine_info(engine)
    assert hashes == []
    assert re.search(r"verified 4 engine file\(s\) \([\d.]+ MiB\) against the manifest in [\d.]+s "
                     r"\(0 hashed, 4 trusted by stamp\)", caplog.text)
    # The stamps live in the cache, not in the engine (which may be read-only or shared).
    assert stamp_file(engine).parent == cache_dir / "verified" and stamp_file(engine).is_file()
    assert sorted(p.name for p in engine.iterdir()) == ["engine.json", "rank0.safetensors", "tokenizer"]


def test_a_touched_file_is_hashed_again(engine, hashes):
    load_engine_info(engine)
    weights = engine / "rank0.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    hashes.clear()
    load_engine_info(engine)
    assert hashes == ["rank0.safetensors"]


def test_a_file_modified_after_its_stamp_is_caught(engine):
    load_engine_info(engine)
    weights = engine / "rank0.safetensors"
    st = weights.stat()
    flip_last_byte(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: ctime still differs
    with pytest.raises(EngineError, match=r"rank0\.safetensors has sha256 that differs"):
        load_engine_info(engine)


def test_an_unwritable_cache_still_loads(engine, tmp_path, monkeypatch, hashes):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("KILN_CACHE_DIR", str(blocker / "cache"))
    load_engine_info(engine)
    load_engine_info(engine)  # no stamps could be kept: hashed again, still fine
    assert hashes.count("rank0.safetensors") == 2


def test_a_damaged_stamp_file_only_costs_a_rehash(engine, hashes):
    load_engine_info(engine)
    stamp_file(engine).write_text("{not json")
    hashes.clear()
    load_engine_info(engine)
    assert "rank0.safetensors" in hashes
    hashes.clear()
    load_engine_info(engine)
    assert hashes == []


def test_generate_no_verify_checksums_flag(engine, capsys):
    flip_last_byte(engine / "rank0.safetensors")
    argv = ["generate", "--engine", str(engine), "--prompt", "x", "--max-tokens", "2"]
    assert main([*argv, "--no-verify-checksums"]) == 0
    capsys.readouterr()
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "rank0.safetensors has sha256 that differs" in line and line.endswith("copy it again completely")


# -- engine files that lie: one line naming file, key and value -------------------------------------------


@pytest.mark.parametrize("text, reason", [
    ('{"version": "1.0", "trunc', "tokenizer.json is not valid JSON: Unterminated string"),
    ('{"model": {}}', "tokenizer.json is not a valid tokenizer"),
])
def test_corrupt_tokenizer_json_names_the_file(engine, text, reason, capsys):
    rewrite_listed_file(engine, "tokenizer/tokenizer.json", text)
    with pytest.raises(EngineError) as info:
        load_engine_info(engine)
    message = str(info.value)
    assert message.startswith(f"cannot load the tokenizer in {engine / 'tokenizer'}: {reason}")
    assert "\n" not in message
    assert main(["generate", "--engine", str(engine), "--prompt", "x"]) == 2
    assert reason in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("change, expected", [
    (lambda c: c.__setitem__("num_layers", "abc"), "model_config: num_layers='abc' must be an integer"),
    (lambda c: c.__setitem__("num_layers", 0), "model_config: config field num_layers=0 must be a positive integer"),
    (lambda c: c.pop("num_heads"), "model_config: missing key(s) num_heads"),
    (lambda c: c["rope"].__setitem__("theta", "x"), "model_config: rope.theta='x' must be a number"),
    (lambda c: c.__setitem__("num_hidden_layers", 8), "model_config: unknown key(s) num_hidden_layers"),
])
def test_bad_model_config_names_engine_json_the_key_and_the_value(engine, change, expected):
    edit_engine_json(engine, lambda d: change(d["model_config"]))
    with pytest.raises(EngineError) as info:
        load_engine_info(engine)
    assert str(info.value).startswith(f"{engine / 'engine.json'}: {expected}; rebuild the engine")


def test_unknown_architecture_names_engine_json(engine):
    edit_engine_json(engine, lambda d: d.__setitem__("architecture", "GPT2LMHeadModel"))
    with pytest.raises(EngineError, match=r"engine\.json: architecture: architecture 'GPT2LMHeadModel' is not "
                                          r"supported.*upgrade kiln"):
        load_engine_info(engine)


# -- a build replaces only a kiln engine ------------------------------------------------------------------


def dummy_build(output: Path) -> Path:
    return build_engine(EXAMPLES / "kiln-tiny-code", output, BuildConfig(dummy_weights=True, max_seq_len=64),
                        progress=False)


def test_build_refuses_an_engine_directory_holding_a_stranger_file(engine):
    (engine / "notes.txt").write_text("mine")
    (engine / "data").mkdir()
    (engine / "data" / "x.csv").write_text("1,2")
    before = sorted(p.name for p in engine.iterdir())
    with pytest.raises(BuildError, match=r"holds files that are not part of a kiln engine \(data/, notes\.txt\); "
                                         r"choose another --output or remove them"):
        dummy_build(engine)
    assert sorted(p.name for p in engine.iterdir()) == before
    assert not list(engine.parent.glob(".engine*"))
    LLM(engine)  # the engine itself is untouched too


@pytest.mark.parametrize("document", ['{"name": "my project"}', "not json", '["format_version"]'])
def test_build_refuses_a_directory_whose_engine_json_is_not_a_kiln_engines(tmp_path, document):
    output = tmp_path / "project"
    output.mkdir()
    (output / "engine.json").write_text(document)
    with pytest.raises(BuildError, match=r"project has an engine\.json that is not a kiln engine's"):
        dummy_build(output)
    assert (output / "engine.json").read_text() == document


def test_build_replaces_a_real_engine(engine):
    dummy_build(engine)
    assert json.loads((engine / "engine.json").read_text())["build_config"]["dummy_weights"] is True
    assert not list(engine.parent.glob(".engine*"))


def test_files_that_appear_during_a_build_keep_the_old_engine(engine):
    with pytest.raises(BuildError, match=r"late\.txt"):
        with staged_directory(engine, check_replace=_check_output) as staging:
            (staging / "engine.json").write_text("{}")
            (engine / "late.txt").write_text("written while the build ran")
    assert (engine / "late.txt").exists() and (engine / "rank0.safetensors").exists()
    assert not list(engine.parent.glob(".engine*"))
