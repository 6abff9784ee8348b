"""What a new user reads when something is off: errors in the words and flags they typed, advice that can
work, and nothing printed for a request that is refused. Also the file modes of a built engine."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from model_factory import make_checkpoint

import kiln
from kiln.cli import main
from kiln.commands.flags import with_flags

MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Hugging Face checkpoint; `engine` is built from it."""
    return make_checkpoint(tmp_path_factory.mktemp("messages") / "ckpt")[0]


@pytest.fixture(scope="module")
def engine(checkpoint):
    output = checkpoint.parent / "engine"
    argv = ["build", "--checkpoint", str(checkpoint), "--output", str(output), "--max-batch-size", "4",
            "--max-num-tokens", "64", "--max-seq-len", str(MAX_SEQ_LEN)]
    previous = os.umask(0o022)  # a user's usual umask; what the builder chooses shows through it
    try:
        assert main(argv) == 0
    finally:
        os.umask(previous)
    return output


def _run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kiln {kiln.__version__}"


def test_a_built_engine_is_readable_by_all(engine):
    """engine.json and every file 0644, directories 0755 (under umask 022): a server running as another user
    can load it."""
    modes = {str(p.relative_to(engine)): stat.S_IMODE(p.stat().st_mode) for p in engine.rglob("*")}
    assert "engine.json" in modes and "rank0.safetensors" in modes
    files = {name: oct(mode) for name, mode in modes.items() if not (engine / name).is_dir()}
    dirs = {name: oct(mode) for name, mode in modes.items() if (engine / name).is_dir()}
    assert files == {name: "0o644" for name in files}
    assert dirs == {name: "0o755" for name in dirs}
    assert oct(stat.S_IMODE(engine.stat().st_mode)) == "0o755"


# ---- engines and devices -----------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve", "--http-port", "0", "--grpc-port",
                                                                     "0", "--metrics-port", "0"]])
def test_a_checkpoint_given_as_engine_says_to_build_from_it(checkpoint, capsys, command):
    code, out, err = _run([command[0], "--engine", str(checkpoint), *command[1:]], capsys)
    assert code == 2 and out == ""
    assert "this looks like a Hugging Face checkpoint" in err
    assert f"`kiln build --checkpoint {checkpoint} --output ENGINE_DIR`" in err
    assert f"--output {checkpoint}" not in err and "rebuild" not in err


def test_mps_is_not_supported_and_the_advice_names_cpu_or_cuda(engine, capsys):
    code, out, err = _run(["generate", "--engine", str(engine), "--prompt", "hi", "--device", "mps"], capsys)
    assert code == 2 and out == ""
    assert "device 'mps' is not supported: kiln runs on cpu or cuda" in err
    assert "--device cpu" in err and "kiln build --device mps" not in err


def test_an_unknown_device_names_the_ones_kiln_runs_on(engine, capsys):
    code, _, err = _run(["generate", "--engine", str(engine), "--prompt", "hi", "--device", "gpu0"], capsys)
    assert code == 2 and "device 'gpu0' is not a device kiln runs on: use cpu or cuda" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_says_so_instead_of_advising_a_rebuild(engine, capsys):
    code, out, err = _run(["generate", "--engine", str(engine), "--prompt", "hi", "--device", "cuda"], capsys)
    assert code == 2 and out == ""
    assert "no CUDA device is available here" in err and "leave --device out" in err
    assert "kiln build --device cuda" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", [[], ["--device", "cpu"]])
def test_a_cuda_engine_without_cuda_says_where_it_can_run(engine, tmp_path, capsys, device):
    import shutil

    cuda_engine = tmp_path / "cuda-engine"
    shutil.copytree(engine, cuda_engine)
    document = json.loads((cuda_engine / "engine.json").read_text())
    document["target"]["device_type"] = "cuda"
    (cuda_engine / "engine.json").write_text(json.dumps(document))
    code, _, err = _run(["generate", "--engine", str(cuda_engine), "--prompt", "hi", *device], capsys)
    assert code == 2 and "no CUDA device is available here" in err and "--device cuda" not in err
    assert "run it on a machine with a CUDA GPU" in err and "kiln build --device cpu" in err


# ---- generate: the user's flags, and nothing printed for a refused request ------------------------------
@pytest.mark.parametrize(("flags", "message"), [
    (["--top-p", "0"], "--top-p 0.0 is invalid: must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature -1.0 is invalid"),
    (["--top-k", "-2"], "--top-k -2 is invalid"),
    (["--max-tokens", "0"], "--max-tokens 0 is invalid"),
    (["--max-tokens", str(MAX_SEQ_LEN)], f"+ --max-tokens ({MAX_SEQ_LEN})"),
    (["--max-batch-size", "9"], "--max-batch-size 9 exceeds the engine's built limit 4"),
    (["--kv-cache-memory-fraction", "2"], "--kv-cache-memory-fraction 2.0 must be in (0, 1]"),
])
def test_generate_errors_name_the_flags_and_print_nothing_else(engine, capsys, flags, message):
    code, out, err = _run(["generate", "--engine", str(engine), "--prompt", "the cat sat", *flags], capsys)
    assert code == 2 and out == ""
    assert err.startswith("kiln generate: error: ") and message in err, err
    assert "SamplingParams" not in err and "top_p" not in err and "max_tokens" not in err


def test_generate_still_prints_the_prompt_and_completion(engine, capsys):
    code, out, _ = _run(["generate", "--engine", str(engine), "--prompt", "the cat", "--max-tokens", "3"], capsys)
    assert code == 0 and out.startswith("the cat") and out.endswith("\n")


# ---- eval perplexity ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "message"), [
    (["--window", "5000"], "--window 5000 exceeds what the engine takes"),
    (["--window", "1"], "--window must be at least 2"),
    (["--max-tokens", "1"], "--max-tokens must be at least 2"),
])
def test_perplexity_errors_name_the_flags(engine, tmp_path, capsys, flags, message):
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 4)
    code, _, err = _run(["eval", "perplexity", "--engine", str(engine), "--text-file", str(text), *flags], capsys)
    assert code == 2 and message in err and "window_len" not in err and "max_tokens" not in err


def test_a_directory_as_text_file_is_called_a_directory(engine, tmp_path, capsys):
    code, _, err = _run(["eval", "perplexity", "--engine", str(engine), "--text-file", str(tmp_path)], capsys)
    assert code == 2 and f"--text-file {tmp_path}: is a directory" in err and "no such file" not in err


def test_serve_config_errors_name_the_flags(engine, capsys):
    code, _, err = _run(["serve", "--engine", str(engine), "--shutdown-timeout", "-1"], capsys)
    assert code == 2 and "--shutdown-timeout -1.0 is invalid" in err and "ServeConfig" not in err


# ---- the translation itself -------------------------------------------------------------------------------
FLAGS = {"top_p": "--top-p", "max_tokens": "--max-tokens", "window_len": "--window", "prompt": "--prompt",
         "engine": "--engine", "http_port": "--http-port"}


@pytest.mark.parametrize(("message", "expected"), [
    ("SamplingParams.top_p=0 is invalid: must be in (0, 1]", "--top-p 0 is invalid: must be in (0, 1]"),
    ("ServeConfig.http_port=70000 is invalid", "--http-port 70000 is invalid"),
    ("window_len 5000 exceeds what the engine takes (max_seq_len - 1 = 63)",
     "--window 5000 exceeds what the engine takes (max_seq_len - 1 = 63)"),
    ("prompt (9 tokens) + max_tokens (64) = 73 exceeds max_seq_len 64",
     "prompt (9 tokens) + --max-tokens (64) = 73 exceeds max_seq_len 64"),
    ("engine e was built; rebuild with --max-tokens 3", "engine e was built; rebuild with --max-tokens 3"),
    ("max_tokens_total and my_max_tokens stay", "max_tokens_total and my_max_tokens stay"),
    ("prompt=1 and engine=e", "--prompt 1 and --engine e"),
])
def test_with_flags(message, expected):
    assert with_flags(message, FLAGS) == expected
    assert with_flags(message, {}) == message
