"""What every tool-call format shares: a call read out of a model's answer (`ToolCall`, `Parsed`), the check that
a decoded call names a function of the request (`call_of`), and the grammars that constrain an answer to one
call (`one_call_schema`, `json_grammar`). The formats themselves: tool_calls.py (llama3_json, hermes; the
registry), deepseek_tools.py, harmony.py.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from kiln.serve.errors import InvalidRequest
from kiln.serve.openai.tool_specs import Tool


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    """A finished answer: `content` is the text before the calls (all of it when there are none)."""

    content: str
    calls: list[ToolCall]


def call_of(obj, tools: Sequence[Tool], keys: tuple[str, ...]) -> ToolCall | None:
    """A decoded JSON value -> the call it is, or None when it is not a call of one of `tools`."""
    if not isinstance(obj, dict) or not any(t.name == obj.get("name") for t in tools):
        return None
    arguments = next((obj[key] for key in keys if key in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def one_call_schema(tools: Sequence[Tool], arguments_key: str) -> dict:
    """The JSON schema of one call: {"name": <a tool's name>, <arguments_key>: <its parameters>}."""
    cases = [{"type": "object", "properties": {"name": {"const": t.name}, arguments_key: t.parameters},
              "required": ["name", arguments_key], "additionalProperties": False} for t in tools]
    return cases[0] if len(cases) == 1 else {"anyOf": cases}


def json_grammar(schema: dict):
    """xgrammar's grammar of a JSON value following `schema`, compact (no free whitespace, as the models' own
    templates show calls); a schema xgrammar cannot take is a 400 naming `tools`."""
    import xgrammar as xgr

    try:
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except Exception as e:  # xgrammar's RuntimeError/ValueError for a schema it cannot take
        raise InvalidRequest(f"tools: a function's parameters are not a JSON schema that guided decoding "
                             f"can follow: {e}", "tools") from None


def held_from_tag(text: str, tag: str) -> int:
    """Streaming: where text that may be a call starts when calls open with `tag`: at the tag, or at an end of
    the text that may be its start; len(text) when neither."""
    start = text.find(tag)
    if start >= 0:
        return start
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return len(text) - size
    return len(text)
