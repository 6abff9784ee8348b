"""Values a client sent in JSON that Python takes but nothing after it can use, found before any of them is used.

A lone surrogate (`"\\ud800"`) is valid JSON but not Unicode: tokenizers and `.encode()` fail on it. An integer
of thousands of digits is valid JSON too, but no field takes one, `float()` overflows on it, and beyond 4300
digits Python will neither parse nor print it. Each becomes a 400 naming where it is, never a 500.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from kiln.serve.errors import InvalidRequest

# No field of either API takes an integer this large (seeds are below 2**64, token ids far below).
MAX_INT = 2**64
_SURROGATE = re.compile("[\ud800-\udfff]")  # in a Python str, any of these is unpaired (JSON pairs are joined)


@dataclass(frozen=True)
class LongInt:
    """An integer too long for Python to parse, as the JSON had it: only its number of digits."""

    digits: int


def shown(value, limit: int = 80) -> str:
    """`value` as JSON for an error message, cut to `limit` characters; safe for any integer."""
    if isinstance(value, int) and not -MAX_INT < value < MAX_INT:
        return f"<an integer of {_digits(value)} digits>"
    try:
        text = json.dumps(value)
    except ValueError:  # holds an integer past Python's int-to-str limit
        return f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _digits(value: int) -> int:
    try:
        return len(str(abs(value)))
    except ValueError:  # past the int-to-str limit: close enough for a message
        return int(abs(value).bit_length() * math.log10(2)) + 1


def surrogate_error(where: str, text: str, param: str | None) -> InvalidRequest:
    """The error for `text` (at `where`) holding a lone surrogate."""
    char = _SURROGATE.search(text).group()
    return InvalidRequest(f"{where} contains a lone surrogate (\\u{ord(char):04x}), which is not valid Unicode",
                          param)


def check_values(body: dict) -> None:
    """InvalidRequest naming the first string (or key) in `body` with a lone surrogate, or integer no field takes.
    Iterative (any nesting that parsing allowed is fine), and a path is only spelled out for what is refused."""
    stack: list[tuple[str, str, object]] = [(key, key, value) for key, value in reversed(body.items())]
    _check_keys(body, "the request body", None)
    while stack:
        path, param, value = stack.pop()  # param: the top-level field that `path` is in
        if isinstance(value, dict):
            _check_keys(value, path, param)
            stack.extend((f"{path}.{key}", param, item) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            if value and set(map(type, value)) == {int} and -MAX_INT < min(value) and max(value) < MAX_INT:
                continue  # token ids: checked at C speed (a prompt may hold a million)
            nested = []
            for i, item in enumerate(value):
                if isinstance(item, (dict, list)):
                    nested.append((f"{path}[{i}]", param, item))
                elif _unusable(item):
                    _refuse(f"{path}[{i}]", param, item)
            stack.extend(reversed(nested))
        elif _unusable(value):
            _refuse(path, param, value)


def _unusable(value) -> bool:
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    return isinstance(value, LongInt) or (isinstance(value, int) and not -MAX_INT < value < MAX_INT)


def _check_keys(obj: dict, path: str, param: str | None) -> None:
    for key in obj:
        if _SURROGATE.search(key):
            raise surrogate_error(f"a key of {path}", key, param or key)


def _refuse(where: str, param: str, value) -> None:
    if isinstance(value, str):
        raise surrogate_error(where, value, param)
    digits = value.digits if isinstance(value, LongInt) else _digits(value)
    raise InvalidRequest(f"{where}=<an integer of {digits} digits> is invalid: no field takes an integer that large",
                         param)


def long_integer_error(raw: bytes) -> InvalidRequest | None:
    """For a body that Python's JSON parser refused: the error naming an integer it could not parse because of
    its length, if that was the reason (None otherwise)."""
    def parse_int(digits: str) -> int | LongInt:
        try:
            return int(digits)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            return LongInt(len(digits.lstrip("-")))

    try:
        body = json.loads(raw, parse_int=parse_int)
    except (ValueError, RecursionError):
        return None  # invalid for some other reason
    if not isinstance(body, dict):
        return None
    try:
        check_values(body)
    except InvalidRequest as e:
        return e
    return None
