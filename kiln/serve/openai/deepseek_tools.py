"""DeepSeek's tool-call format (V2.5, V3, R1 and V3.1): calls between DeepSeek's own tokens, after any content.

    V3 (`deepseek_v3`):   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                          ```json
                          {ARGUMENTS}
                          ```<｜tool▁call▁end｜>  (further calls, each after a newline)  <｜tool▁calls▁end｜>
    V3.1 (`deepseek_v31`): <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGUMENTS}<｜tool▁call▁end｜>
                          ...<｜tool▁calls▁end｜>

(the names vLLM's parsers have). The tokens are added, not special, tokens of DeepSeek's tokenizers, so they stay
in the decoded text. Either parser reads both layouts (a call whose part after the separator holds a ```json
block is V3's); each constrains the answer to its own. The last call may lack its end tokens (a model stopped
by max_tokens after the arguments). The format to use follows the chat template the engine serves
(tool_calls.default_parser): V3.1's renders the name before the separator.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from kiln.runtime.core.guided_decoding import GuidedDecoding
from kiln.serve.openai.tool_call_base import Parsed, ToolCall, call_of, held_from_tag, json_grammar
from kiln.serve.openai.tool_specs import Tool

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_V3, DEEPSEEK_V31 = "deepseek_v3", "deepseek_v31"
# One call: what precedes the separator and what follows it, up to its end token or the end of the text.
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)(?:" + re.escape(CALL_END) + r"|\Z)",
                   re.DOTALL)
# V3's part after the separator: the name, then the arguments in a ```json block (closing fence optional).
_V3_BODY = re.compile(r"(.*?)\n```json\n(.*?)(?:\n```)?\s*\Z", re.DOTALL)


def _read_call(before: str, after: str, tools: Sequence[Tool]) -> ToolCall | None:
    """One call's two parts (around <｜tool▁sep｜>) -> the call, or None when it is not one of `tools`."""
    v3 = _V3_BODY.match(after)
    name, arguments = (v3.group(1), v3.group(2)) if v3 else (before, after)
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return None
    return call_of({"name": name.strip(), "arguments": decoded}, tools, ("arguments",))


class DeepSeekParser:
    """parse / held_from / constraint (tool_output.ToolOutput's parser interface) for one of the two layouts."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, tools: Sequence[Tool]) -> Parsed:
        start = text.find(CALLS_BEGIN)
        if start < 0:
            return Parsed(text, [])
        body = text[start + len(CALLS_BEGIN):].split(CALLS_END, 1)[0]
        calls = []
        for match in _CALL.finditer(body):
            call = _read_call(match.group(1), match.group(2), tools)
            if call is None:
                return Parsed(text, [])
            calls.append(call)
        return Parsed(text[:start], calls) if calls else Parsed(text, [])

    def held_from(self, text: str) -> int:
        """Streaming: text from <｜tool▁calls▁begin｜> on is held, and an end that might be the start of it."""
        return held_from_tag(text, CALLS_BEGIN)

    def constraint(self, tools: Sequence[Tool]) -> GuidedDecoding:
        """One call of one of `tools` in this parser's layout, its arguments following that tool's schema: per
        tool the literal opening (with its name), the arguments' JSON grammar and the closing, as one union."""
        import xgrammar as xgr

        def literal(text: str):
            return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")

        cases = []
        for tool in tools:
            if self.name == DEEPSEEK_V3:
                opening = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{tool.name}\n```json\n"
                closing = f"\n```{CALL_END}{CALLS_END}"
            else:
                opening, closing = f"{CALLS_BEGIN}{CALL_BEGIN}{tool.name}{SEP}", f"{CALL_END}{CALLS_END}"
            cases.append(xgr.Grammar.concat(literal(opening), json_grammar(tool.parameters), literal(closing)))
        grammar = cases[0] if len(cases) == 1 else xgr.Grammar.union(*cases)
        return GuidedDecoding(grammar=str(grammar))


def deepseek_layout(chat_template: str | None) -> str:
    """deepseek_v31 for a chat template that renders a call's name before <｜tool▁sep｜> (V3.1's), deepseek_v3
    otherwise (V2.5's, V3's and R1's put the type there, and a template that renders no calls says nothing)."""
    if chat_template and SEP in chat_template and "```json" not in chat_template:
        return DEEPSEEK_V31
    return DEEPSEEK_V3
