"""The `kiln` command line, run in-process through `main(argv)` (and once as a real process)."""

import json
import shutil
import subprocess
import sys

import pytest
from model_factory import make_checkpoint

from kiln.cli import main
from kiln.runtime import LLM, SamplingParams

BUILD_FLAGS = ("--checkpoint", "--output", "--dtype", "--device", "--max-batch-size", "--max-num-tokens",
               "--max-seq-len", "--kv-block-size", "--dummy-weights")
GENERATE_FLAGS = ("--engine", "--prompt", "--max-tokens", "--temperature", "--top-k", "--top-p", "--seed")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("cli") / "ckpt")[0]


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory):
    output = tmp_path_factory.mktemp("cli") / "engine"
    assert main(["build", "--checkpoint", str(checkpoint), "--output", str(output), "--max-batch-size", "4",
                 "--max-num-tokens", "64", "--max-seq-len", "128", "--kv-block-size", "8"]) == 0
    return output


def test_build_writes_the_engine_with_the_flags_limits(engine):
    build_config = json.loads((engine / "engine.json").read_text())["build_config"]
    assert {k: build_config[k] for k in ("dtype", "max_batch_size", "max_num_tokens", "max_seq_len",
                                         "kv_block_size")} == {
        "dtype": "float32", "max_batch_size": 4, "max_num_tokens": 64, "max_seq_len": 128, "kv_block_size": 8}


def test_build_says_which_dtype_auto_picked(checkpoint, tmp_path, capsys):
    capsys.readouterr()
    assert main(["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--max-seq-len", "64"]) == 0
    assert "(float32, picked by --dtype auto for cpu)" in capsys.readouterr().err
    assert main(["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "f"), "--max-seq-len", "64",
                 "--dtype", "float16"]) == 0
    err = capsys.readouterr().err
    assert "(float16) in" in err and "picked" not in err


def test_generate_prints_the_prompt_and_its_greedy_completion(engine, capsys):
    capsys.readouterr()
    assert main(["generate", "--engine", str(engine), "--prompt", "the cat", "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    expected = LLM(engine).generate("the cat", SamplingParams(max_tokens=5, temperature=0))[0]
    assert expected.text  # the comparison below would be vacuous otherwise
    assert out == "the cat" + expected.text + "\n"


def test_generate_with_sampling_flags_is_reproducible(engine, capsys):
    argv = ["generate", "--engine", str(engine), "--prompt", "the cat", "--max-tokens", "6", "--temperature",
            "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "7"]
    outputs = []
    for _ in range(2):
        capsys.readouterr()
        assert main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("the cat")


def test_build_dummy_weights_and_dtype_flags(checkpoint, tmp_path):
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy2(checkpoint / "config.json", config_only / "config.json")
    output = tmp_path / "engine"
    assert main(["build", "--checkpoint", str(config_only), "--output", str(output), "--dummy-weights",
                 "--dtype", "bfloat16", "--device", "cpu", "--max-seq-len", "64"]) == 0
    build_config = json.loads((output / "engine.json").read_text())["build_config"]
    assert (build_config["dummy_weights"], build_config["dtype"]) == (True, "bfloat16")


@pytest.mark.parametrize(("command", "flags"), [("build", BUILD_FLAGS), ("generate", GENERATE_FLAGS)])
def test_help_lists_every_flag_of_the_interface(command, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert [f for f in flags if f not in text] == []


def test_kiln_runs_as_a_program():
    kiln = shutil.which("kiln")
    argv = [kiln, "--help"] if kiln else [sys.executable, "-m", "kiln.cli", "--help"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "build" in done.stdout and "generate" in done.stdout


def test_generate_into_a_closed_pipe_stops_quietly(engine):
    """`kiln generate ... | head`: the reader leaves early (here at once: `true` reads nothing, and has exited
    long before the engine loads); kiln stops without a traceback, as a pipe writer killed by SIGPIPE."""
    kiln = shutil.which("kiln")
    argv = ([kiln] if kiln else [sys.executable, "-m", "kiln.cli"]) + [
        "generate", "--engine", str(engine), "--prompt", "hello", "--max-tokens", "16"]
    done = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | true', "kiln", *argv],
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 141, done.stderr


def _error_line(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_generate_missing_engine_exits_2_with_one_line(tmp_path, capsys):
    assert main(["generate", "--engine", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 2
    err = _error_line(capsys)
    assert err.startswith("kiln generate: error: ") and "nowhere does not exist" in err


def test_generate_invalid_top_p_exits_2_naming_it(engine, capsys):
    assert main(["generate", "--engine", str(engine), "--prompt", "hi", "--top-p", "0"]) == 2
    err = _error_line(capsys)
    assert err.startswith("kiln generate: error: ") and "--top-p" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--checkpoint", "{tmp}/nowhere"], "checkpoint directory"),
    (["--checkpoint", "{checkpoint}", "--kv-block-size", "3"], "kv_block_size=3"),
    (["--checkpoint", "{checkpoint}", "--max-batch-size", "0"], "max_batch_size=0"),
])
def test_build_errors_exit_2_with_one_line(args, message, checkpoint, tmp_path, capsys):
    output = tmp_path / "engine"
    argv = ["build", *(a.format(tmp=tmp_path, checkpoint=checkpoint) for a in args), "--output", str(output)]
    assert main(argv) == 2
    err = _error_line(capsys)
    assert err.startswith("kiln build: error: ") and message in err
    assert not output.exists()


def test_build_into_a_non_engine_directory_exits_2(checkpoint, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path)]) == 2
    assert "not an engine" in _error_line(capsys)
    assert (tmp_path / "notes.txt").read_text() == "mine"
