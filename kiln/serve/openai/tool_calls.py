"""Tool calls in the model's own format: reading them out of its text, and the constraint that makes it write one.

Two formats, picked by `kiln serve --tool-call-parser` (default: by architecture, `default_parser`), read here; a
third, harmony (GPT-OSS: calls in the commentary channel, reasoning in the analysis channel, read from every
answer, tools or not), is read by harmony.py:
- llama3_json (Llama 3.x, Mistral): the whole answer is `{"name": ..., "parameters": {...}}` (Llama 3.1's
  templates say "parameters"; "arguments" is read too), possibly after `<|python_tag|>`, several calls
  separated by `;`.
- hermes (Qwen2, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, after
  any plain text (the message's content).
A text is read as tool calls only if every call in it parses and names a function of the request; otherwise it
is plain content. `constraint(tools)` is the GuidedDecoding that makes the model write exactly one call of one of
`tools` in the format, its arguments following that function's `parameters` schema (tool_choice "required" or a
named function), so what it writes always parses.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from kiln.runtime.core.guided_decoding import GuidedDecoding
from kiln.serve.errors import InvalidRequest
from kiln.serve.openai.tool_specs import Tool

LLAMA3_JSON = "llama3_json"
HERMES = "hermes"
HARMONY = "harmony"
PARSER_NAMES = (LLAMA3_JSON, HERMES, HARMONY)
# Hugging Face architecture prefix -> the format its chat templates ask for.
_ARCHITECTURE_PARSERS = (("Llama", LLAMA3_JSON), ("Mistral", LLAMA3_JSON), ("Qwen2", HERMES), ("Qwen3", HERMES),
                         ("GptOss", HARMONY))
# A chat template that renders this renders harmony (GPT-OSS's, whatever the architecture string says).
_HARMONY_MARK = "<|channel|>"


# Hugging Face architecture prefix -> the tool-call format kiln does not read yet: a request with tools is refused.
_UNREAD_FORMATS = (("Deepseek", "DeepSeek's tool-call tokens (<｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>)"),)


def check_tools_readable(architecture: str) -> None:
    """InvalidRequest (field `tools`) for a model whose tool calls kiln cannot read out of its text."""
    for prefix, fmt in _UNREAD_FORMATS:
        if architecture.startswith(prefix):
            raise InvalidRequest(f"tools: {architecture} writes tool calls in {fmt}, which kiln does not parse "
                                 f"yet; send the request without tools", "tools")


def default_parser(architecture: str, chat_template: str | None = None) -> str:
    """The format for a model of this architecture, or harmony for a chat template that renders it; llama3_json
    for one not listed."""
    if chat_template and _HARMONY_MARK in chat_template:
        return HARMONY
    return next((parser for prefix, parser in _ARCHITECTURE_PARSERS if architecture.startswith(prefix)), LLAMA3_JSON)


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


def _call(obj, tools: Sequence[Tool], keys: tuple[str, ...]) -> ToolCall | None:
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


def _one_call_schema(tools: Sequence[Tool], arguments_key: str) -> dict:
    """The JSON schema of one call: {"name": <a tool's name>, <arguments_key>: <its parameters>}."""
    cases = [{"type": "object", "properties": {"name": {"const": t.name}, arguments_key: t.parameters},
              "required": ["name", arguments_key], "additionalProperties": False} for t in tools]
    return cases[0] if len(cases) == 1 else {"anyOf": cases}


class Llama3JsonParser:
    name = LLAMA3_JSON
    PYTHON_TAG = "<|python_tag|>"
    _decoder = json.JSONDecoder()

    def parse(self, text: str, tools: Sequence[Tool]) -> Parsed:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return Parsed(text, [])
        calls: list[ToolCall] = []
        position = 0
        while True:
            try:
                obj, end = self._decoder.raw_decode(body, position)
            except ValueError:
                return Parsed(text, [])
            call = _call(obj, tools, ("parameters", "arguments"))
            if call is None:
                return Parsed(text, [])
            calls.append(call)
            rest = body[end:].lstrip()
            if rest.startswith(";"):  # Llama 3.2's separator between calls (also after the last one)
                rest = rest[1:].lstrip()
            elif rest:
                return Parsed(text, [])  # text after the JSON: an answer that happens to start with {
            if not rest:
                return Parsed("", calls)
            position = len(body) - len(rest)

    def held_from(self, text: str) -> int:
        """Streaming: where the text that might still be a tool call starts (len(text): none of it). An answer
        that starts (after whitespace) with `{` or `<|python_tag|>` is held to the end."""
        start = text.lstrip()
        if not start or start.startswith("{") or start.startswith(self.PYTHON_TAG) \
                or self.PYTHON_TAG.startswith(start):
            return 0
        return len(text)

    def constraint(self, tools: Sequence[Tool]) -> GuidedDecoding:
        return GuidedDecoding(json=_one_call_schema(tools, "parameters"))


class HermesParser:
    name = HERMES
    START, END = "<tool_call>", "</tool_call>"
    # a block, or an unclosed last one (a model that stopped before writing the end tag)
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str, tools: Sequence[Tool]) -> Parsed:
        start = text.find(self.START)
        if start < 0:
            return Parsed(text, [])
        calls = []
        for block in self._BLOCK.finditer(text, start):
            try:
                obj = json.loads(block.group(1))
            except ValueError:
                return Parsed(text, [])
            call = _call(obj, tools, ("arguments", "parameters"))
            if call is None:
                return Parsed(text, [])
            calls.append(call)
        return Parsed(text[:start], calls)

    def held_from(self, text: str) -> int:
        """Streaming: text from `<tool_call>` on is held, and an end that might be the start of one."""
        start = text.find(self.START)
        if start >= 0:
            return start
        for size in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-size:]):
                return len(text) - size
        return len(text)

    def constraint(self, tools: Sequence[Tool]) -> GuidedDecoding:
        """`<tool_call>\\n` + the call's JSON (compact, as Qwen's templates show it) + `\\n</tool_call>`, as an EBNF
        grammar that xgrammar builds from the JSON schema."""
        import xgrammar as xgr

        try:
            call = xgr.Grammar.from_json_schema(json.dumps(_one_call_schema(tools, "arguments")),
                                                any_whitespace=False)
        except Exception as e:  # xgrammar's RuntimeError/ValueError for a schema it cannot take
            raise InvalidRequest(f"tools: a function's parameters are not a JSON schema that guided decoding "
                                 f"can follow: {e}", "tools") from None
        tags = (xgr.Grammar.from_ebnf(f"root ::= {json.dumps(self.START + chr(10))}"), call,
                xgr.Grammar.from_ebnf(f"root ::= {json.dumps(chr(10) + self.END)}"))
        return GuidedDecoding(grammar=str(xgr.Grammar.concat(*tags)))


PARSERS = {LLAMA3_JSON: Llama3JsonParser(), HERMES: HermesParser()}
