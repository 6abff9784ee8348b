"""A default quantized build says what it calibrated on without alarming: kiln's own sample filling fewer than
the default --calib-size is stated, not warned about, and transformers' warning about a text longer than the
model's maximum length stays off where kiln tokenizes the calibration text whole on purpose. A --calib-size the
user gave and the data cannot fill is still a warning."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import transformers
from model_factory import make_checkpoint

from kiln.cli import main
from kiln.quant.calib_data import DEFAULT_CALIB_SIZE, calibration_samples, read_calibration_texts
from kiln.quant.calibrate import _report_size

BUNDLED = Path(__file__).resolve().parent.parent / "examples" / "kiln-tiny-code"
LENGTH_WARNING = "Token indices sequence length is longer than the specified maximum sequence length"
FEWER = "fewer than --calib-size"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_default_sample_is_tokenized_whole_without_the_length_warning():
    tokenizer = transformers.AutoTokenizer.from_pretrained(BUNDLED)  # model_max_length 1024
    records = _Records()
    library = logging.getLogger("transformers")  # transformers' loggers do not propagate to the root
    library.addHandler(records)
    try:
        samples = calibration_samples(read_calibration_texts(None), tokenizer, DEFAULT_CALIB_SIZE, 512)
    finally:
        library.removeHandler(records)
    assert not [m for m in records.messages if LENGTH_WARNING in m]
    assert len(samples) == 159 and all(s[0] == tokenizer.bos_token_id for s in samples)  # docs/quantization.md


def test_fewer_samples_warn_only_for_a_calib_size_the_user_gave(caplog):
    data = read_calibration_texts(None)
    caplog.set_level(logging.INFO, logger="kiln.quant")
    _report_size(data, 159, 512, None)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "calibrating on 159 samples of up to 512 tokens" in caplog.text and FEWER not in caplog.text
    caplog.clear()
    _report_size(data, 159, 512, 512)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert f"159 samples of up to 512 tokens, {FEWER} 512" in caplog.text
    caplog.clear()
    _report_size(data, 32, 256, 32)
    assert [r.levelno for r in caplog.records] == [logging.INFO]


@pytest.mark.slow
def test_a_default_fp8_build_warns_about_neither(tmp_path, caplog, capfd):
    """`kiln build --qformat fp8` with every calibration default (kiln's sample, up to 512 windows of 512
    tokens: 159), on a tiny random Llama that has the bundled model's tokenizer (model_max_length 1024, the
    sample 80,857 tokens), so that it takes seconds, not the bundled model's minutes."""
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", tokenizer=False, vocab_size=8192, max_position_embeddings=1024,
                                    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / name, checkpoint / name)
    caplog.set_level(logging.INFO, logger="kiln")
    capfd.readouterr()
    assert main(["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "engine"), "--dtype",
                 "float32", "--qformat", "fp8", "--max-seq-len", "128"]) == 0
    out, err = capfd.readouterr()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert LENGTH_WARNING not in out + err + caplog.text and FEWER not in err + caplog.text
    assert "calibrating on 159 samples of up to 512 tokens" in caplog.text  # stated, at info level
    assert ": 159 samples, " in err  # and in the build summary
