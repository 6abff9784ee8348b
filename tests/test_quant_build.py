"""`kiln build --qformat / --kv-cache-dtype`: quantized engines of a tiny random model, each format through
ModelOpt's calibration and the runtime; what engine.json records; bad input refused before any work."""

from __future__ import annotations

import json
import re

import pytest
from model_factory import make_checkpoint

from kiln.builder.build import BuildError, build_engine
from kiln.builder.build_config import BuildConfig
from kiln.cli import main
from kiln.engine_format import load_engine_spec
from kiln.runtime import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3], [8, 8, 250, 31, 7, 64, 2, 90, 11], [300, 1, 44], [120, 121, 122, 123, 124, 125]]
SMALL = dict(dtype="float32", max_batch_size=8, max_num_tokens=16, max_seq_len=128, kv_block_size=8,
             calib_size=4, calib_max_seq_len=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("quant") / "ckpt")
    return path


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    lines = [json.dumps({"text": " ".join(f"word{(i * 7 + j) % 50}" for j in range(40))}) for i in range(8)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _greedy(engine, prompts, **runtime):
    llm = LLM(engine, **runtime)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def full_precision(checkpoint, tmp_path_factory):
    engine = build_engine(checkpoint, tmp_path_factory.mktemp("fp") / "engine", BuildConfig(**SMALL), progress=False)
    return _greedy(engine, PROMPTS)


@pytest.mark.parametrize("qformat, kv", [("fp8", "auto"), ("int8_sq", "auto"), ("int4_awq", "auto"),
                                         ("int8_wo", "auto"), ("int4_wo", "auto"), ("full_prec", "fp8"),
                                         ("full_prec", "int8"), ("int4_awq", "fp8")])
def test_each_format_builds_calibrates_and_runs(checkpoint, calib_file, full_precision, tmp_path, qformat, kv):
    config = BuildConfig(**SMALL, qformat=qformat, kv_cache_dtype=kv, awq_block_size=32,
                         calib_dataset=str(calib_file))
    engine = build_engine(checkpoint, tmp_path / "engine", config, progress=False)
    spec = load_engine_spec(engine)
    assert spec.format_version == 2
    recorded = spec.build_config["quantization"]
    assert recorded["qformat"] == qformat and recorded["kv_cache_dtype"] == kv
    assert recorded["exclude_modules"] == ["lm_head"]
    calibrated = qformat in ("fp8", "int8_sq", "int4_awq") or kv != "auto"
    assert (recorded["calibration"] is not None) == calibrated
    if calibrated:
        assert recorded["modelopt_version"]
        assert recorded["calibration"]["dataset"] == "calib.jsonl"
        assert recorded["calibration"]["num_samples"] == 4
    assert recorded["group_size"] == (32 if qformat.startswith("int4") else None)
    assert spec.build_config["kv_cache_dtype"] == (kv if kv != "auto" else "float32")
    assert (spec.build_config["kv_cache_scales"] is not None) == (kv != "auto")

    alone = [_greedy(engine, [p])[0] for p in PROMPTS]
    # In-flight batching with chunked prefill (16 tokens a step) and the prefix cache: the same tokens.
    batched = _greedy(engine, PROMPTS)
    assert batched == alone
    # A random model has near ties; the first tokens still mostly agree with full precision.
    agree = sum(a[0] == b[0] for a, b in zip(batched, full_precision))
    assert agree >= len(PROMPTS) - 1, (batched, full_precision)


def test_a_group_size_that_does_not_divide_a_layer_fails_before_any_work(checkpoint, tmp_path):
    config = BuildConfig(**SMALL, qformat="int4_wo", awq_block_size=48)
    with pytest.raises(BuildError, match=r"model\.layers\.0\.self_attn\.qkv_proj: in_features 64 is not divisible by "
                                         r"the group size 48"):
        build_engine(checkpoint, tmp_path / "engine", config, progress=False)
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("content, message", [(None, "does not exist"), (b"", "is empty"),
                                               (b"\xff\xfe bad", "is not UTF-8")])
def test_a_bad_calibration_file_fails_before_any_work(checkpoint, tmp_path, content, message):
    path = tmp_path / "calib.txt"
    if content is not None:
        path.write_bytes(content)
    config = BuildConfig(**SMALL, qformat="fp8", calib_dataset=str(path))
    with pytest.raises(BuildError, match=message):
        build_engine(checkpoint, tmp_path / "engine", config, progress=False)
    assert not (tmp_path / "engine").exists()


def test_weight_only_formats_read_no_calibration_file(checkpoint, tmp_path, caplog):
    config = BuildConfig(**SMALL, qformat="int8_wo", calib_dataset=str(tmp_path / "missing.txt"))
    build_engine(checkpoint, tmp_path / "engine", config, progress=False)
    assert "--calib-dataset is not used" in caplog.text


def test_unknown_qformat_on_the_command_line_lists_the_valid_ones(checkpoint, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--qformat", "int3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--qformat" in err and "int3" in err and "int4_awq" in err and "int8_wo" in err


@pytest.mark.parametrize("qformat, kv", [("fp8", "fp8"), ("int4_awq", "auto"), ("int8_sq", "auto")])
def test_dummy_weights_quantize_without_calibration(checkpoint, tmp_path, qformat, kv):
    """Every calibrated format builds from dummy weights (speed runs), formats that keep something per part of
    a fused layer (AWQ's pre_quant_scale per q, k, v) included."""
    config = BuildConfig(**SMALL, qformat=qformat, kv_cache_dtype=kv, dummy_weights=True, awq_block_size=32)
    engine = build_engine(checkpoint, tmp_path / "engine", config, progress=False)
    assert load_engine_spec(engine).build_config["quantization"]["calibration"] is None
    assert len(_greedy(engine, PROMPTS[:1])[0]) == 8


def test_build_prints_weight_and_kv_bytes(checkpoint, tmp_path, capsys):
    assert main(["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--dtype", "float32",
                 "--qformat", "int4_wo", "--awq-block-size", "32", "--kv-cache-dtype", "int8",
                 "--calib-size", "2", "--calib-max-seq-len", "32", "--max-seq-len", "128"]) == 0
    err = capsys.readouterr().err
    assert "(int4_wo; float32 would be" in err
    assert "KV cache 128 bytes/token (int8; float32 would be 512)" in err  # 2 layers x 2 kv heads x 16 x (k, v)


def test_eval_text_prints_perplexity_before_and_after(checkpoint, tmp_path, capsys):
    text = tmp_path / "eval.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    assert main(["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--dtype", "float32",
                 "--qformat", "int8_wo", "--max-seq-len", "128", "--eval-text", str(text)]) == 0
    err = capsys.readouterr().err
    assert re.search(r"perplexity on --eval-text \(\d+ tokens\): full precision [\d.]+, int8_wo [\d.]+ \([+-][\d.]+%\)",
                     err), err


def test_a_bad_eval_text_fails_before_building(checkpoint, tmp_path, capsys):
    assert main(["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--qformat", "int8_wo",
                 "--eval-text", str(tmp_path / "missing.txt")]) != 0
    assert "--eval-text" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_a_bad_calibration_file_on_the_command_line_names_the_flag(checkpoint, tmp_path, capsys):
    assert main(["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--qformat", "fp8",
                 "--calib-dataset", str(tmp_path / "nope.jsonl")]) != 0
    err = capsys.readouterr().err
    assert "--calib-dataset" in err and "nope.jsonl does not exist" in err
