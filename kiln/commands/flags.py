"""Error messages in the user's words: the runtime names its fields (`SamplingParams.top_p=0`, `window_len`),
a command's user typed flags (`--top-p 0`, `--window`)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping

# `SamplingParams.top_p=0`, `ServeConfig.http_port=70000`: a field of a typed config, set to a value.
_OWNER = r"(?:SamplingParams|ServeConfig)\."


def field_flags(parser: argparse.ArgumentParser, aliases: Mapping[str, str] | None = None) -> dict[str, str]:
    """Field name -> flag for every option of `parser` (its dest, e.g. top_p -> --top-p), plus `aliases`, fields
    named otherwise than their option's dest (e.g. {"window_len": "window"}). Call after adding every option."""
    flags = {action.dest: max(action.option_strings, key=len) for action in parser._actions
             if action.option_strings and action.dest != "help"}
    flags.update({field: flags[dest] for field, dest in (aliases or {}).items()})
    return flags


def with_flags(message: str, flags: Mapping[str, str]) -> str:
    """`message` with each field the user set by a flag named by that flag: `SamplingParams.top_p=0 is invalid`
    -> `--top-p 0 is invalid`, `window_len 5000 exceeds` -> `--window 5000 exceeds`. A bare word is taken for a
    field only if it has an underscore (`max_tokens`), so plain words such as `engine` or `prompt` stay."""
    if not flags:
        return message

    def flag(match: re.Match) -> str:
        field, owner, assigned = match.group("field"), match.group("owner"), match.group("assigned")
        if not (owner or assigned or "_" in field):
            return match.group(0)
        return flags[field] + (" " if assigned else "")

    names = "|".join(re.escape(name) for name in sorted(flags, key=len, reverse=True))
    pattern = rf"(?:(?P<owner>{_OWNER})|(?<![\w.-]))(?P<field>{names})(?![\w-])(?P<assigned>=)?"
    return re.sub(pattern, flag, message)
