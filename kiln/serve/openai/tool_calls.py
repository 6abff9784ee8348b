"""Tool calls in the model's own format: reading them out of its text, and the constraint that makes it write one.

The formats, picked by `kiln serve --tool-call-parser` (default: by architecture and chat template,
`default_parser`); two are read here, DeepSeek's (deepseek_v3, deepseek_v31: calls between DeepSeek's tool tokens)
by deepseek_tools.py, and harmony (GPT-OSS: calls in the commentary channel, reasoning in the analysis channel,
read from every answer, tools or not) by harmony.py. `PARSERS` holds all but harmony:
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
from collections.abc import Sequence

from kiln.runtime.core.guided_decoding import GuidedDecoding
from kiln.serve.openai.deepseek_tools import DEEPSEEK_V3, DEEPSEEK_V31, DeepSeekParser, deepseek_layout
from kiln.serve.openai.tool_call_base import (
    Parsed,
    ToolCall,
    call_of,
    held_from_tag,
    json_grammar,
    one_call_schema,
)
from kiln.serve.openai.tool_specs import Tool

LLAMA3_JSON = "llama3_json"
HERMES = "hermes"
HARMONY = "harmony"
PARSER_NAMES = (LLAMA3_JSON, HERMES, DEEPSEEK_V3, DEEPSEEK_V31, HARMONY)
# Hugging Face architecture prefix -> the format its chat templates ask for (DeepSeek's: by its template).
_ARCHITECTURE_PARSERS = (("Llama", LLAMA3_JSON), ("Mistral", LLAMA3_JSON), ("Qwen2", HERMES), ("Qwen3", HERMES),
                         ("GptOss", HARMONY))
# A chat template that renders this renders harmony (GPT-OSS's, whatever the architecture string says).
_HARMONY_MARK = "<|channel|>"


def default_parser(architecture: str, chat_template: str | None = None) -> str:
    """The format for a model of this architecture, or harmony for a chat template that renders it; DeepSeek's
    V3 or V3.1 layout as its template renders calls; llama3_json for one not listed."""
    if chat_template and _HARMONY_MARK in chat_template:
        return HARMONY
    if architecture.startswith("Deepseek"):
        return deepseek_layout(chat_template)
    return next((parser for prefix, parser in _ARCHITECTURE_PARSERS if architecture.startswith(prefix)), LLAMA3_JSON)


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
            call = call_of(obj, tools, ("parameters", "arguments"))
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
        return GuidedDecoding(json=one_call_schema(tools, "parameters"))


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
            call = call_of(obj, tools, ("arguments", "parameters"))
            if call is None:
                return Parsed(text, [])
            calls.append(call)
        return Parsed(text[:start], calls)

    def held_from(self, text: str) -> int:
        """Streaming: text from `<tool_call>` on is held, and an end that might be the start of one."""
        return held_from_tag(text, self.START)

    def constraint(self, tools: Sequence[Tool]) -> GuidedDecoding:
        """`<tool_call>\\n` + the call's JSON (compact, as Qwen's templates show it) + `\\n</tool_call>`, as an EBNF
        grammar that xgrammar builds from the JSON schema."""
        import xgrammar as xgr

        call = json_grammar(one_call_schema(tools, "arguments"))
        tags = (xgr.Grammar.from_ebnf(f"root ::= {json.dumps(self.START + chr(10))}"), call,
                xgr.Grammar.from_ebnf(f"root ::= {json.dumps(chr(10) + self.END)}"))
        return GuidedDecoding(grammar=str(xgr.Grammar.concat(*tags)))


PARSERS = {LLAMA3_JSON: Llama3JsonParser(), HERMES: HermesParser(), DEEPSEEK_V3: DeepSeekParser(DEEPSEEK_V3),
           DEEPSEEK_V31: DeepSeekParser(DEEPSEEK_V31)}
