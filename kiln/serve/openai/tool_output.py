"""A chat choice's text as OpenAI presents an answer to a request with tools: `message.content` and
`message.tool_calls` (content null when the answer is only calls; finish_reason "tool_calls"), whole or streamed.

Streaming: with tool_choice "auto", text that cannot be the start of a call is streamed as content as it comes;
from where a call might start (the parser's `held_from`) the text is held until the choice ends, then sent as
tool-call deltas — per call, one delta with its `index`, `id`, `type` and function `name` (arguments ""), then
one with the whole `arguments` — or, when it did not parse as calls, as content. With "required" or a named
function the whole answer is a call (the output is constrained), so all of it is held and sent that way.
"""

from __future__ import annotations

from kiln.runtime.core.guided_decoding import GuidedDecoding
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.serve.openai.tool_call_base import Parsed, ToolCall
from kiln.serve.openai.tool_specs import ToolChoice


class ToolOutput:
    """How one request's choices read their text: `parser` (tool_calls.PARSERS) for `choice.tools`. chat.py reads
    answers through this interface (sampling_params, constraint, message, stream().deltas), which harmony.py's
    HarmonyOutput shares."""

    def __init__(self, parser, choice: ToolChoice) -> None:
        self.parser = parser
        self.choice = choice

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        return params

    def constraint(self) -> GuidedDecoding:
        """The output constrained to one call (tool_choice "required" or a named function)."""
        return self.parser.constraint(self.choice.tools)

    def parse(self, text: str) -> Parsed:
        return self.parser.parse(text, self.choice.tools)

    def streamable(self, text: str) -> int:
        """How much of the text so far may be sent as content before the choice ends."""
        return 0 if self.choice.constrained else self.parser.held_from(text)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """-> (the choice's `message`, its finish_reason)."""
        parsed = self.parse(text)
        if not parsed.calls:
            return {"role": "assistant", "content": text}, finish_reason
        return ({"role": "assistant", "content": parsed.content if parsed.content.strip() else None,
                 "tool_calls": [call.openai() for call in parsed.calls]}, finish_reason_with_calls(finish_reason))

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One streamed choice: what to send as each delta arrives, given its text so far."""

    def __init__(self, output: ToolOutput) -> None:
        self.output = output
        self.sent = 0  # characters of the text sent as content

    def step(self, text: str, finished: bool, finish_reason: str | None) -> tuple[str, list[list[dict]], str | None]:
        """-> (content to send now, the tool-call deltas to send after it (each a `tool_calls` list, one per
        chunk), the finish_reason to send once finished)."""
        if not finished:
            end = max(self.sent, self.output.streamable(text))
            piece, self.sent = text[self.sent:end], end
            return piece, [], None
        parsed = self.output.parse(text)
        if not parsed.calls:
            piece, self.sent = text[self.sent:], len(text)
            return piece, [], finish_reason
        piece = parsed.content[self.sent:] if parsed.content.strip() else ""
        return piece, _call_deltas(parsed.calls), finish_reason_with_calls(finish_reason)

    def deltas(self, text: str, finished: bool, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """`step` as the `delta` objects to send now, in order (content, then each tool-call chunk)."""
        piece, calls, finish_reason = self.step(text, finished, finish_reason)
        return ([{"content": piece}] if piece else []) + [{"tool_calls": c} for c in calls], finish_reason


def _call_deltas(calls: list[ToolCall]) -> list[list[dict]]:
    deltas = []
    for index, call in enumerate(calls):
        deltas.append([{"index": index, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}}])
        deltas.append([{"index": index, "function": {"arguments": call.arguments}}])
    return deltas


def finish_reason_with_calls(finish_reason: str | None) -> str | None:
    """An answer that calls tools ends with "tool_calls" (unless the server cut it off)."""
    return finish_reason if finish_reason == "abort" else "tool_calls"
