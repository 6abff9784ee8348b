"""Checking a JSON object from engine.json against the dataclass it will become, before it becomes one.

A dataclass built from `**d` fails on a missing key with a TypeError about positional arguments, and on
a string where a number belongs with whatever comparison its validation makes first. This check names
the key and the value instead, so an edited or damaged engine.json fails in one readable line.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

_JSON_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}


def check_json_fields(cls: type, data: Any, prefix: str = "") -> None:
    """Raises ValueError naming the first missing, unknown or wrongly typed key of `data` for dataclass `cls`.

    Understands the annotations engine configs use: int, float, bool, str, None, unions of them,
    `tuple[X, ...]` / `list[X]` (a JSON array) and nested dataclasses (a JSON object). Values are only
    type-checked; ranges are the dataclass's own business.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'value'}={data!r:.80} must be an object")
    hints = typing.get_type_hints(cls)
    declared = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(declared))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(prefix + k for k in unknown)}")
    missing = [prefix + name for name, f in declared.items() if name not in data and _required(f)]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    for name, value in data.items():
        _check_value(hints[name], value, prefix + name)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _check_value(annotation: Any, value: Any, key: str) -> None:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        check_json_fields(annotation, value, key + ".")
    elif origin in (typing.Union, types.UnionType):
        if not any(_fits(arg, value) for arg in args):
            raise ValueError(f"{key}={value!r:.80} must be {' or '.join(_describe(arg) for arg in args)}")
    elif origin in (tuple, list):
        if not isinstance(value, list):
            raise ValueError(f"{key}={value!r:.80} must be an array")
        for i, item in enumerate(value):
            _check_value(args[0], item, f"{key}[{i}]")
    elif (origin or annotation) is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}={value!r:.80} must be an object")
    elif annotation in _JSON_NAMES and not _scalar_fits(annotation, value):
        raise ValueError(f"{key}={value!r:.80} must be {_describe(annotation)}")
    # any other annotation (Any, ...) is not checked here


def _scalar_fits(annotation: type, value: Any) -> bool:
    if isinstance(value, bool):  # bool is an int subclass in Python; JSON true is neither a count nor a number
        return annotation is bool
    if annotation is float:
        return isinstance(value, (int, float))
    return isinstance(value, annotation)


def _fits(annotation: Any, value: Any) -> bool:
    try:
        _check_value(annotation, value, "")
    except ValueError:
        return False
    return True


def _describe(annotation: Any) -> str:
    if annotation in _JSON_NAMES:
        return _JSON_NAMES[annotation]
    return "an array" if typing.get_origin(annotation) in (tuple, list) else "an object"
