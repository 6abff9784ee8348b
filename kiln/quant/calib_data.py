"""Calibration data: a plain-text file (cut into windows of --calib-max-seq-len tokens) or JSON lines
with a `text` field (one sample per line, truncated), or kiln's default sample (data/calibration-sample.txt:
Python standard-library modules, see scripts/make_calibration_sample.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .base import QuantError

DEFAULT_SAMPLE = Path(__file__).resolve().parent / "data" / "calibration-sample.txt"
DEFAULT_NAME = "kiln default sample (11 Python 3.11 standard-library modules, 300 KB)"
DEFAULT_CALIB_SIZE = 512  # samples taken when --calib-size is not given (fewer when the data gives fewer)


@dataclass(frozen=True)
class CalibrationTexts:
    name: str  # what engine.json records: the file's name, or DEFAULT_NAME
    texts: tuple[str, ...]
    is_jsonl: bool  # one sample per text (JSON lines) rather than windows over one text


def read_calibration_texts(path: str | Path | None) -> CalibrationTexts:
    """The texts of `path` (None: kiln's default sample). A QuantError names a missing, empty or non-UTF-8
    file, or the JSON line that is not an object with a string `text`."""
    if path is None:
        return CalibrationTexts(DEFAULT_NAME, (DEFAULT_SAMPLE.read_text(encoding="utf-8"),), False)
    path = Path(path)
    if not path.is_file():
        raise QuantError(f"--calib-dataset {path} does not exist or is not a file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QuantError(f"--calib-dataset {path} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                         f"pass a plain-text file or JSON lines with a 'text' field") from None
    if not text.strip():
        raise QuantError(f"--calib-dataset {path} is empty")
    if path.suffix == ".jsonl" or text.lstrip().startswith("{"):
        return CalibrationTexts(path.name, _jsonl_texts(path, text), True)
    return CalibrationTexts(path.name, (text,), False)


def _jsonl_texts(path: Path, text: str) -> tuple[str, ...]:
    texts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise QuantError(f"--calib-dataset {path} line {number} is not JSON ({e}); JSON lines need one object "
                             f"with a 'text' field per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise QuantError(f"--calib-dataset {path} line {number} has no string 'text' field")
        if record["text"].strip():
            texts.append(record["text"])
    if not texts:
        raise QuantError(f"--calib-dataset {path} has no non-empty 'text'")
    return tuple(texts)


def calibration_samples(data: CalibrationTexts, tokenizer, num_samples: int, max_seq_len: int) -> list[list[int]]:
    """At most `num_samples` token-id lists of at most `max_seq_len` tokens. Plain text is cut into
    consecutive windows, each starting with the tokens the tokenizer puts in front of a text (BOS), as a
    prompt would. Texts are tokenized whole on purpose (then cut), so transformers' warning about a text longer
    than the model's maximum length is turned off (verbose=False)."""
    if data.is_jsonl:
        samples = [tokenizer(t, add_special_tokens=True, verbose=False).input_ids[:max_seq_len]
                   for t in data.texts[:num_samples]]
        return [s for s in samples if s]
    prefix = tokenizer("", add_special_tokens=True).input_ids
    body = max_seq_len - len(prefix)
    if body < 1:
        raise QuantError(f"--calib-max-seq-len {max_seq_len} leaves no room after the tokenizer's {len(prefix)} "
                         f"special token(s)")
    ids = tokenizer(data.texts[0], add_special_tokens=False, verbose=False).input_ids
    windows = [prefix + ids[i:i + body] for i in range(0, len(ids), body)][:num_samples]
    return windows
