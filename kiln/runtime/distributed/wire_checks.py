"""The checks of the step channel's JSON messages (step_codec.py): the format version, the keys, and
integers, floats and lists of them, each failure a `StepCodecError` naming the field. The checks of long lists
run in C (`set(map(type, ...))`, `min`, `max`); only a failure walks the list to name the bad element."""

from __future__ import annotations

import json
import math
from typing import Any

FORMAT_VERSION = 1


class StepCodecError(ValueError):
    """A message on the step channel that does not follow its schema (or a step that has no wire form)."""


def load_message(data: bytes, what: str) -> dict:
    try:
        message = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise StepCodecError(f"step channel: the {what} message is not JSON ({type(e).__name__}: {e})"[:300]) from None
    if type(message) is not dict:
        raise StepCodecError(f"step channel: a message must be a JSON object, got {type(message).__name__}")
    if message.get("v") != FORMAT_VERSION:
        raise StepCodecError(f"step channel: message format {message.get('v')!r}, this rank reads "
                             f"{FORMAT_VERSION} (every rank must run the same kiln version)")
    return message


def check_keys(message: dict, expected: frozenset, what: str) -> None:
    keys = message.keys()
    if keys != expected:
        extra, missing = sorted(keys - expected), sorted(expected - keys)
        raise StepCodecError(f"{what}: " + "; ".join(
            ([f"unexpected field(s) {extra}"] if extra else []) + ([f"missing field(s) {missing}"] if missing else [])))


def int_list(message: dict, name: str, low: int, high: int, length: int | None,
              label: str | None = None) -> list[int]:
    """message[name], checked to be a list of `length` ints in [low, high) (bools are not ints here). The
    checks run in C; only a failure walks the list to name the bad element."""
    value = message[name]
    field = label or f"'{name}'"
    if type(value) is not list:
        raise StepCodecError(f"step field {field} must be a list of integers, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise StepCodecError(f"step field {field} has {len(value)} entries, expected {length}")
    if value and (set(map(type, value)) != {int} or min(value) < low or max(value) >= high):
        for i, item in enumerate(value):
            int_value(item, low, high, f"step field {field}[{i}]")
    return value


def where_greater(a: list[int], b: list[int]) -> list[int]:
    """The indices where a[i] > b[i] (the common case, none, in C)."""
    if not any(map(int.__gt__, a, b)):
        return []
    return [i for i, (x, y) in enumerate(zip(a, b)) if x > y]


def int_value(value: Any, low: int, high: int, field: str) -> int:
    if type(value) is not int:
        raise StepCodecError(f"{field} must be an integer, got {type(value).__name__} {value!r}"[:200])
    if not low <= value < high:
        raise StepCodecError(f"{field}={value} is out of range [{low}, {high})")
    return value


def int_tuple(value: Any, field: str) -> tuple[int, ...]:
    """A JSON list of non-negative int32s as a tuple."""
    if type(value) is not list:
        raise StepCodecError(f"{field} must be a list of integers, got {type(value).__name__}")
    return tuple(int_value(v, 0, 2**31, field) for v in value)


def float_value(value: Any, field: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise StepCodecError(f"{field} must be a finite number, got {type(value).__name__} {value!r}"[:200])
    return float(value)


def str_list(message: dict, name: str) -> list[str]:
    value = message[name]
    if type(value) is not list or (value and set(map(type, value)) != {str}):
        raise StepCodecError(f"step field '{name}' must be a list of strings")
    return value
