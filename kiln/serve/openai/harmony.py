"""GPT-OSS's harmony output format in /v1/chat/completions: its channels read into OpenAI's chat message, whole or
streamed, and the constraint that makes it write one tool call.

After the generation prompt (`<|start|>assistant`) the model writes messages, each a header, `<|message|>`, a
body and a terminator (`<|end|>`, `<|call|>` after a tool call, `<|return|>` after the answer):

    <|channel|>analysis<|message|>reasoning<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

The recipient (`to=functions.NAME`) may also sit before `<|channel|>`. Read into OpenAI's message:
`reasoning_content` (vLLM's name; `reasoning` too) is the analysis bodies, `content` the final bodies (and
commentary without a recipient: preambles the user may see), `tool_calls` the commentary messages to
`functions.NAME` of a function the request offers (any other recipient's body is content). The text must keep the
harmony tokens, which are special tokens: `sampling_params` turns `skip_special_tokens` off and adds `<|call|>` and
`<|return|>` to the stop ids; none of them reaches the client's content.

Streaming reads the whole text so far at each step (so any split of the text into chunks gives the same
deltas): what can no longer change is sent — body text up to a possible partial `<|` marker, a call's id and name
once its header is complete, its arguments as they come (whitespace around them held back).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from kiln.runtime.core.guided_decoding import GuidedDecoding
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.serve.errors import InvalidRequest
from kiln.serve.openai.tool_call_base import ToolCall, new_call_id
from kiln.serve.openai.tool_specs import Tool, ToolChoice

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL, RETURN = "<|call|>", "<|return|>"
# The tokens that end the model's turn: stop ids of every harmony request.
STOP_TOKENS = (CALL, RETURN)
_TERMINATORS = (END, CALL, RETURN, START)  # a body ends at the first of these (<|start|>: a missing <|end|>)
_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")
_FUNCTIONS = "functions."
_REASONING_SEPARATOR = "\n"  # between two analysis messages' bodies


@dataclass(frozen=True)
class Message:
    """One harmony message of the answer: `body` so far, `complete` once its terminator came."""

    channel: str
    recipient: str | None
    body: str
    complete: bool


def read_messages(text: str) -> tuple[list[Message], str]:
    """The messages in the text so far -> (messages, text that is in no message: what precedes a first header
    that never came, for a model that did not write harmony). A header not complete yet is left out."""
    messages: list[Message] = []
    position = 0
    while True:
        at = text.find(MESSAGE, position)
        if at < 0:
            return messages, ("" if messages else text)
        channel, recipient = _header(text[position:at])
        start = at + len(MESSAGE)
        end, terminator = min(((i, t) for t in _TERMINATORS if (i := text.find(t, start)) >= 0),
                              default=(len(text), None))
        messages.append(Message(channel, recipient, text[start:end], terminator is not None))
        if terminator is None:
            return messages, ""
        position = end + (0 if terminator == START else len(terminator))


def _header(header: str) -> tuple[str, str | None]:
    """`<|start|>assistant to=R<|channel|>commentary json` or `<|channel|>commentary to=R <|constrain|>json`
    -> (channel, recipient)."""
    header = header.replace(START, "")
    _, _, channel_part = header.partition(CHANNEL)
    words = channel_part.replace(CONSTRAIN, " ").split()
    found = _RECIPIENT.search(header)
    return (words[0] if words else ""), (found.group(1) if found else None)


def _held(body: str) -> int:
    """How much of a body still being written can be sent: all but a tail that may be the start of a marker."""
    at = body.rfind("<")
    if at >= 0 and any(marker.startswith(body[at:]) for marker in _MARKERS):
        return at
    return len(body)


@dataclass(frozen=True)
class Reading:
    """The text so far as OpenAI's fields: reasoning, content and the calls, each (name, arguments); while the
    choice goes on, only what can no longer change."""

    reasoning: str
    content: str
    calls: list[tuple[str, str]]


def read(text: str, tools: tuple[Tool, ...], final: bool) -> Reading:
    """The text so far -> what it says. `final`: the choice has ended (nothing is held back)."""
    messages, loose = read_messages(text)
    names = {tool.name for tool in tools}
    reasoning: list[str] = []
    content: list[str] = [loose] if final else []
    calls: list[tuple[str, str]] = []
    for message in messages:
        body = message.body if message.complete or final else message.body[:_held(message.body)]
        recipient = message.recipient or ""
        name = recipient[len(_FUNCTIONS):] if recipient.startswith(_FUNCTIONS) else None
        if name in names:
            arguments = body.strip() if message.complete or final else body[:len(body.rstrip())].lstrip()
            calls.append((name, arguments))
        elif message.channel == "analysis":
            reasoning.append(body)
        else:  # final, commentary preambles, and calls the request cannot take
            content.append(body)
    return Reading(_REASONING_SEPARATOR.join(reasoning), "".join(content), calls)


class HarmonyOutput:
    """How one request's choices read a GPT-OSS answer: channels always, tool calls of `choice.tools`."""

    def __init__(self, tokenizer, choice: ToolChoice) -> None:
        self.choice = choice
        ids = (_token_id(tokenizer, token) for token in STOP_TOKENS) if tokenizer is not None else ()
        self.stop_token_ids = tuple(i for i in ids if i is not None)

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """The harmony tokens kept in the text (the parser needs them) and the turn's end tokens as stop ids."""
        stops = params.stop_token_ids + tuple(t for t in self.stop_token_ids if t not in params.stop_token_ids)
        return replace(params, skip_special_tokens=False, stop_token_ids=stops)

    def constraint(self) -> GuidedDecoding:
        return constraint(self.choice.tools)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """-> (the choice's `message`, its finish_reason)."""
        reading = read(text, self.choice.tools, final=True)
        calls = [ToolCall(name, arguments) for name, arguments in reading.calls]
        message = {"role": "assistant", "content": reading.content or (None if calls or reading.reasoning else ""),
                   "reasoning_content": reading.reasoning or None, "reasoning": reading.reasoning or None}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
            return message, _with_calls(finish_reason)
        return message, finish_reason

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self.choice.tools)


class HarmonyStream:
    """One streamed choice: the deltas to send as its text grows."""

    def __init__(self, tools: tuple[Tool, ...]) -> None:
        self.tools = tools
        self.reasoning_sent = 0
        self.content_sent = 0
        self.calls_sent: list[tuple[str, int]] = []  # per call: (id, characters of its arguments sent)

    def deltas(self, text: str, finished: bool, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """-> (the `delta` objects to send now, in order; the finish_reason to send once finished)."""
        reading = read(text, self.tools, final=finished)
        out: list[dict] = []
        reasoning = reading.reasoning[self.reasoning_sent:]
        if reasoning:
            out.append({"reasoning_content": reasoning, "reasoning": reasoning})
            self.reasoning_sent = len(reading.reasoning)
        content = reading.content[self.content_sent:]
        if content:
            out.append({"content": content})
            self.content_sent = len(reading.content)
        for index, (name, arguments) in enumerate(reading.calls):
            if index == len(self.calls_sent):
                self.calls_sent.append((new_call_id(), 0))
                out.append({"tool_calls": [{"index": index, "id": self.calls_sent[index][0], "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            call_id, sent = self.calls_sent[index]
            if len(arguments) > sent:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": arguments[sent:]}}]})
                self.calls_sent[index] = (call_id, len(arguments))
        if finished and self.calls_sent:
            finish_reason = _with_calls(finish_reason)
        return out, finish_reason


def _token_id(tokenizer, token: str) -> int | None:
    """The id of a token of the vocabulary, None when it has none (a fast tokenizer's lookup: building the whole
    vocabulary dict would cost each request milliseconds on a 200k vocabulary)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.token_to_id(token)
    return tokenizer.get_vocab().get(token)


def _with_calls(finish_reason: str | None) -> str | None:
    """An answer that calls tools ends with "tool_calls" when the model ended its turn (<|call|>, a stop); one cut
    off ("length", "abort") keeps its reason: its last call may be incomplete."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def constraint(tools: tuple[Tool, ...]) -> GuidedDecoding:
    """One call of one of `tools` (tool_choice "required" or a named function), as the model writes it: an
    optional analysis message first (its text free but for `<|`), then
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` + arguments following the function's
    parameters schema (compact JSON) + `<|call|>`. An EBNF grammar that xgrammar builds from the schemas."""
    import xgrammar as xgr

    def literal(text: str):
        return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")

    calls = []
    for tool in tools:
        try:
            arguments = xgr.Grammar.from_json_schema(json.dumps(tool.parameters), any_whitespace=False)
        except Exception as e:  # xgrammar's RuntimeError/ValueError for a schema it cannot take
            raise InvalidRequest(f"tools: the parameters of {tool.name!r} are not a JSON schema that guided "
                                 f"decoding can follow: {e}", "tools") from None
        head = f"{CHANNEL}commentary to={_FUNCTIONS}{tool.name} {CONSTRAIN}json{MESSAGE}"
        calls.append(xgr.Grammar.concat(literal(head), arguments, literal(CALL)))
    call = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    analysis = xgr.Grammar.from_ebnf(
        f'root ::= {json.dumps(CHANNEL + "analysis" + MESSAGE)} text {json.dumps(END + START + "assistant")}\n'
        'text ::= ([^<] | "<" [^|])*')
    return GuidedDecoding(grammar=str(xgr.Grammar.union(xgr.Grammar.concat(analysis, call), call)))
