"""Hostile or broken model files are bounded and refused before work: a config.json or engine.json value no
model has (a million layers, 1e15 positions, zero heads, a NaN rope theta, an EOS outside the vocabulary)
fails at once in one line naming the file, the key and the value, without allocating anything large; a
NaN weight fails the build naming the tensor unless --allow-non-finite; and a killed build's staging
directory is removed by the next build of the same output, never one that a running build still writes."""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kiln.builder.build import BuildError, build_engine
from kiln.builder.build_config import BuildConfig
from kiln.cli import main
from kiln.engine_format import EngineError
from kiln.engine_format.build_owner import OWNER_FILE
from kiln.engine_format.limits import check_build_limits
from kiln.engine_format.staging import staged_directory
from kiln.runtime.worker.engine_loader import load_engine_info

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = EXAMPLES / "kiln-tiny-code"  # vocab 8192, 6 heads / 2 KV heads, head_dim 64, 8 layers
NAN_TENSOR = "model.layers.3.mlp.down_proj.weight"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Engine stamps go to a private cache, never the real home's."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))


@contextlib.contextmanager
def fast_and_small():
    """The block runs in under 2 s, and neither Python objects (tracemalloc) nor the process (max RSS) grow by
    more than a little: a refused value is refused before anything is sized by it."""
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    tracemalloc.start()
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert elapsed < 2, f"took {elapsed:.1f}s"
    assert peak < 64 << 20, f"Python allocations peaked at {peak >> 20} MiB"
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown < 256 << 10, f"max RSS grew by {grown >> 10} MiB"


# -- config.json ------------------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return Path(shutil.copytree(TINY, tmp_path / "ckpt"))


def edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def setter(key, value):
    return lambda d: d.__setitem__(key, value)


CONFIG_CASES = {
    "million_layers": (setter("num_hidden_layers", 1_000_000),
                       "num_hidden_layers=1000000 exceeds kiln's limit 1024"),
    "10**15_layers": (setter("num_hidden_layers", 10**15), "num_hidden_layers=1000000000000000 exceeds kiln's limit"),
    "huge_positions": (setter("max_position_embeddings", 10**15),
                       "max_position_embeddings=1000000000000000 exceeds kiln's limit 16777216"),
    "float_positions": (setter("max_position_embeddings", 1e15),
                        "max_position_embeddings=1000000000000000.0 must be a positive integer"),
    "zero_heads": (setter("num_attention_heads", 0), "num_attention_heads=0 must be a positive integer"),
    "zero_kv_heads": (setter("num_key_value_heads", 0), "num_key_value_heads=0 must be a positive integer"),
    "heads_not_multiple_of_kv_heads": (setter("num_key_value_heads", 4),
                                       "num_attention_heads=6 is not a multiple of num_key_value_heads=4"),
    "hidden_not_multiple_of_heads": (lambda d: (d.pop("head_dim"), d.__setitem__("hidden_size", 385)),
                                     "hidden_size=385 is not a multiple of num_attention_heads=6"),
    "huge_hidden": (setter("hidden_size", 1 << 20), "hidden_size=1048576 exceeds kiln's limit 131072"),
    "negative_intermediate": (setter("intermediate_size", -1), "intermediate_size=-1 must be a positive integer"),
    "huge_vocab": (setter("vocab_size", 1 << 30), "vocab_size=1073741824 exceeds kiln's limit 4194304"),
    "bool_layers": (setter("num_hidden_layers", True), "num_hidden_layers=True must be a positive integer"),
    "nan_rope_theta": (lambda d: d["rope_parameters"].__setitem__("rope_theta", float("nan")),
                       "rope_theta=nan must be a finite number > 0"),
    "inf_rope_theta": (lambda d: d["rope_parameters"].__setitem__("rope_theta", float("inf")),
                       "rope_theta=inf must be a finite number > 0"),
    "negative_rms_norm_eps": (setter("rms_norm_eps", -1e-5), "rms_norm_eps=-1e-05 must be a finite number > 0"),
    "nan_rms_norm_eps": (setter("rms_norm_eps", float("nan")), "rms_norm_eps=nan must be a finite number > 0"),
    "eos_outside_vocab": (setter("eos_token_id", 8192),
                          r"eos_token_id=8192 is not a token of the vocabulary (ids 0..8191, vocab_size=8192)"),
    "one_eos_of_two_outside_vocab": (setter("eos_token_id", [1, -3]), "eos_token_id[1]=-3 is not a token"),
    "bos_outside_vocab": (setter("bos_token_id", 10**9), "bos_token_id=1000000000 is not a token"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_absurd_config_json_fails_fast_naming_file_key_and_value(case, checkpoint, tmp_path):
    change, expected = CONFIG_CASES[case]
    edit_json(checkpoint / "config.json", change)
    output = tmp_path / "engine"
    with fast_and_small(), pytest.raises(BuildError) as info:
        build_engine(checkpoint, output, BuildConfig(max_seq_len=64), progress=False)
    message = str(info.value)
    assert message.startswith(f"{checkpoint / 'config.json'}: "), message
    assert expected in message, message
    assert "\n" not in message
    assert not output.exists() and not list(tmp_path.glob(".engine*"))


def test_eos_outside_vocab_in_generation_config_names_that_file(checkpoint, tmp_path):
    edit_json(checkpoint / "generation_config.json", setter("eos_token_id", 9000))
    with fast_and_small(), pytest.raises(BuildError) as info:
        build_engine(checkpoint, tmp_path / "engine", BuildConfig(max_seq_len=64), progress=False)
    assert str(info.value).startswith(f"{checkpoint / 'generation_config.json'}: eos_token_id=9000 is not a token")


def test_pad_token_outside_vocab_only_warns(checkpoint, tmp_path, caplog):
    # kiln never reads pad_token_id, and real configs carry odd ones: a warning, not a refusal.
    edit_json(checkpoint / "config.json", setter("pad_token_id", 9000))
    with caplog.at_level(logging.WARNING):
        build_engine(checkpoint, tmp_path / "engine", BuildConfig(dummy_weights=True, max_seq_len=64),
                     progress=False)
    assert "pad_token_id=9000 is outside the vocabulary (vocab_size=8192)" in caplog.text


def test_config_that_does_not_fit_the_weights_fails_before_any_weight_is_written(checkpoint, tmp_path):
    edit_json(checkpoint / "config.json", setter("intermediate_size", 4096))
    expected = r"implies model\.layers\.0\.mlp\.gate_up_proj\.weight of shape \[8192, 384\]; does config\.json belong"
    with pytest.raises(BuildError, match=expected):  # once untimed: torch imports its meta kernels on first use
        build_engine(checkpoint, tmp_path / "engine", BuildConfig(max_seq_len=64), progress=False)
    with fast_and_small(), pytest.raises(BuildError, match=expected):
        build_engine(checkpoint, tmp_path / "engine", BuildConfig(max_seq_len=64), progress=False)
    assert not list(tmp_path.glob(".engine*"))


def test_default_max_seq_len_too_large_for_the_batch_names_the_flag(checkpoint, tmp_path):
    # 2**24 positions are allowed, but 64 requests of them in blocks of 1 are 2**30 block-table entries.
    edit_json(checkpoint / "config.json", setter("max_position_embeddings", 1 << 24))
    with fast_and_small(), pytest.raises(BuildError) as info:
        build_engine(checkpoint, tmp_path / "engine", BuildConfig(kv_block_size=1), progress=False)
    assert str(info.value).startswith("max_batch_size=64 x max_seq_len=16777216 / kv_block_size=1 is 1073741824 "
                                      "KV-block-table entries, over kiln's limit 134217728")
    assert "max_position_embeddings; pass --max-seq-len" in str(info.value)


@pytest.mark.parametrize("options, expected", [
    (dict(max_batch_size=10**9), "max_batch_size=1000000000 exceeds kiln's limit 65536"),
    (dict(max_num_tokens=1 << 30), "max_num_tokens=1073741824 exceeds kiln's limit 1048576"),
    (dict(max_seq_len=10**15), "max_seq_len=1000000000000000 exceeds kiln's limit 16777216"),
    (dict(kv_block_size=3), "kv_block_size=3 must be a power of two up to 256"),
    (dict(kv_block_size=512), "kv_block_size=512 exceeds kiln's limit 256"),
])
def test_build_limits_are_bounded_like_engine_json(options, expected):
    with pytest.raises(ValueError, match=expected):
        BuildConfig(**options)


def test_cli_build_limit_is_one_error_line(checkpoint, tmp_path, capsys):
    assert main(["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"),
                 "--max-batch-size", "1000000000"]) == 2
    assert capsys.readouterr().err.strip() == ("kiln build: error: max_batch_size=1000000000 exceeds kiln's limit "
                                               "65536")


# -- engine.json ------------------------------------------------------------------------------------------


@pytest.fixture
def engine(tiny_code_engine, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_code_engine, tmp_path / "engine"))


def build_config(key, value):
    return lambda d: d["build_config"].__setitem__(key, value)


def model_config(key, value):
    return lambda d: d["model_config"].__setitem__(key, value)


ENGINE_CASES = {
    "huge_batch": (build_config("max_batch_size", 10**9),
                   "build_config: max_batch_size=1000000000 exceeds kiln's limit 65536"),
    "huge_tokens": (build_config("max_num_tokens", 10**12),
                    "build_config: max_num_tokens=1000000000000 exceeds kiln's limit 1048576"),
    "huge_seq_len": (build_config("max_seq_len", 10**15),
                     "build_config: max_seq_len=1000000000000000 exceeds kiln's limit 16777216"),
    "block_size_3": (build_config("kv_block_size", 3), "build_config: kv_block_size=3 must be a power of two"),
    "block_size_0": (build_config("kv_block_size", 0), "build_config: kv_block_size=0 must be a positive integer"),
    "block_tables_too_large": (lambda d: d["build_config"].update(max_batch_size=4096, max_seq_len=1 << 20),
                               "build_config: max_batch_size=4096 x max_seq_len=1048576 / kv_block_size=16 is "
                               "268435456 KV-block-table entries, over kiln's limit 134217728"),
    "million_layers": (model_config("num_layers", 1_000_000),
                       "model_config: config field num_layers=1000000 exceeds kiln's limit 1024"),
    "huge_positions": (model_config("max_position_embeddings", 10**15),
                       "model_config: config field max_position_embeddings=1000000000000000 exceeds kiln's limit"),
    "zero_heads": (model_config("num_heads", 0), "model_config: config field num_heads=0 must be a positive integer"),
    "huge_vocab": (model_config("vocab_size", 1 << 30), "model_config: config field vocab_size=1073741824 exceeds"),
    "nan_rope_theta": (lambda d: d["model_config"]["rope"].__setitem__("theta", float("nan")),
                       "model_config: rope_theta=nan must be a finite number > 0"),
    "negative_rms_norm_eps": (model_config("rms_norm_eps", -1.0),
                              "model_config: rms_norm_eps=-1.0 must be a finite number > 0"),
    "eos_outside_vocab": (model_config("eos_token_ids", [8192]),
                          "model_config: eos_token_id=8192 is not a token of the vocabulary"),
    "bos_outside_vocab": (model_config("bos_token_id", -1), "model_config: bos_token_id=-1 is not a token"),
    "negative_window": (model_config("layer_sliding_windows", [-1] * 8),
                        "model_config: layer_sliding_windows[0]=-1 must be an integer >= 0"),
}


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_absurd_engine_json_fails_fast_naming_file_key_and_value(case, engine):
    change, expected = ENGINE_CASES[case]
    edit_json(engine / "engine.json", change)
    with fast_and_small(), pytest.raises(EngineError) as info:
        load_engine_info(engine, verify_checksums=False, tokenizer=False)
    message = str(info.value)
    assert message.startswith(f"{engine / 'engine.json'}: {expected}"), message
    assert message.endswith(f"rebuild the engine with `kiln build --checkpoint ... --output {engine}`")


def test_cli_generate_with_absurd_engine_json_is_one_error_line(engine, capsys):
    edit_json(engine / "engine.json", build_config("max_batch_size", 10**9))
    assert main(["generate", "--engine", str(engine), "--prompt", "x"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kiln generate: error:")]
    # (the command names the field by its flag, --max-batch-size, though the value is engine.json's)
    assert len(lines) == 1 and "engine.json: build_config:" in lines[0]
    assert "1000000000 exceeds kiln's limit 65536" in lines[0]


def test_one_check_serves_builder_and_loader():
    # The builder's flags and engine.json's build_config go through the same function (engine_format/limits.py).
    with pytest.raises(ValueError, match="max_seq_len=0 must be a positive integer"):
        check_build_limits(max_batch_size=1, max_num_tokens=1, max_seq_len=0, kv_block_size=16)
    check_build_limits(max_batch_size=2048, max_num_tokens=65536, max_seq_len=131072, kv_block_size=16)


# -- non-finite weights -----------------------------------------------------------------------------------


@pytest.fixture
def nan_checkpoint(checkpoint) -> Path:
    weights = load_file(checkpoint / "model.safetensors")
    weights[NAN_TENSOR][5, 7] = float("nan")
    weights[NAN_TENSOR][0, 0] = float("inf")
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    return checkpoint


def test_nan_weight_is_refused_naming_the_tensor(nan_checkpoint, tmp_path):
    output = tmp_path / "engine"
    with pytest.raises(BuildError) as info:
        build_engine(nan_checkpoint, output, BuildConfig(max_seq_len=64), progress=False)
    assert str(info.value) == (f"checkpoint {nan_checkpoint}: tensor '{NAN_TENSOR}' holds 2 non-finite value(s) (NaN "
                               f"or Inf) of 393216: an engine built from it would compute NaN logits and generate "
                               f"nothing; fix the checkpoint, or build anyway with --allow-non-finite")
    assert not output.exists() and not list(tmp_path.glob(".engine*"))


def test_allow_non_finite_builds_with_a_warning(nan_checkpoint, tmp_path, caplog, capsys):
    output = tmp_path / "engine"
    with caplog.at_level(logging.WARNING, logger="kiln.builder"):
        assert main(["build", "--checkpoint", str(nan_checkpoint), "--output", str(output), "--max-seq-len", "64",
                     "--allow-non-finite"]) == 0
    assert f"tensor '{NAN_TENSOR}' holds 2 non-finite value(s)" in caplog.text
    assert "building anyway (--allow-non-finite)" in caplog.text
    assert (output / "engine.json").is_file()


# -- stale staging directories ----------------------------------------------------------------------------


def dummy_build(output: Path) -> Path:
    return build_engine(TINY, output, BuildConfig(dummy_weights=True, max_seq_len=64), progress=False)


def fake_staging(output: Path, suffix: str = "abcd1234", owner: dict | None = None) -> Path:
    """A staging directory as a build leaves it when killed: some weights written, its owner file."""
    staging = output.parent / f".{output.name}.{suffix}.partial"
    staging.mkdir()
    (staging / "rank0.safetensors").write_bytes(b"\0" * 1024)
    if owner is not None:
        (staging / OWNER_FILE).write_text(json.dumps(owner))
    return staging


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_killed_builds_staging_is_removed_by_the_next_build(tmp_path, caplog):
    output = tmp_path / "engine"
    stale = fake_staging(output, owner={"host": socket.gethostname(), "pid": dead_pid()})
    other_output = fake_staging(tmp_path / "engine.v2", owner={"host": socket.gethostname(), "pid": dead_pid()})
    with caplog.at_level(logging.WARNING, logger="kiln.builder"):
        dummy_build(output)
    assert not stale.exists()
    assert f"removed {stale}, left by a build of {output} that did not finish" in caplog.text
    assert other_output.exists()  # engine.v2's, not this output's
    assert (output / "engine.json").is_file() and not (output / OWNER_FILE).exists()


def test_staging_of_another_host_or_without_owner_is_left(tmp_path, caplog):
    output = tmp_path / "engine"
    elsewhere = fake_staging(output, "elsewher", owner={"host": "another-host", "pid": dead_pid()})
    legacy = fake_staging(output, "legacy00")
    with caplog.at_level(logging.WARNING, logger="kiln.builder"):
        dummy_build(output)
    assert elsewhere.exists() and legacy.exists()
    assert f"{legacy.name} may be left by an unfinished build of engine" in caplog.text


_HOLD_STAGING = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kiln.engine_format.staging import staged_directory
    with staged_directory(Path(sys.argv[1])) as staging:
        print(staging, flush=True)
        time.sleep(120)
""")


def test_a_running_builds_staging_is_kept_until_it_is_killed(tmp_path):
    output = tmp_path / "engine"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_STAGING, str(output)], stdout=subprocess.PIPE, text=True)
    try:
        staging = Path(proc.stdout.readline().strip())
        assert staging.parent == tmp_path and (staging / OWNER_FILE).is_file(), staging
        with staged_directory(output) as mine:  # another build of the same output, while that one runs
            (mine / "engine.json").write_text("{}")
        assert staging.is_dir(), "a running build's staging directory was removed"
    finally:
        proc.kill()  # SIGKILL: no cleanup runs, as when a build is killed
        proc.wait()
    assert staging.is_dir()
    shutil.rmtree(output)
    dummy_build(output)
    assert not staging.exists()
