"""Reasoning between `<think>` and `</think>` read out of chat answers (`kiln serve --reasoning-parser`): the thinking
goes to `message.reasoning_content` (and `reasoning`), the rest is the answer, read for tool calls as without
reasoning.

Where the block opens decides: either the prompt opens it (it ends with `<think>`: DeepSeek-R1's and V3.1's
thinking mode, QwQ and Qwen3's "Thinking" releases put it in their generation prompt), so the answer starts inside
it, or the model opens it itself (Qwen3's hybrid models; a `<think>` it writes after a prompt that opened one is
dropped). Otherwise the answer is all content: a template that closed the block in the prompt (Qwen3's
`enable_thinking: false`, V3.1's non-thinking mode, through `chat_template_kwargs`) or a model that does not think.
An answer cut before `</think>` is all reasoning. vLLM's parser names are taken, `deepseek_r1` and `qwen3`; kiln
reads both this one way (vLLM's deepseek_r1 assumes the prompt opened the block, its qwen3 that the model does).

`<think>` and `</think>` are added, not special, tokens of these tokenizers, so they stay in the text. The
newlines that separate the block from the answer are not part of either. Streamed, reasoning is sent as it comes
(held back only where the text might be the start of `</think>`), then the answer as the tool-call reader streams
it. Only chat reads reasoning; /v1/completions, KServe and Triton return the text unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.runtime.core.sampling_params import SamplingParams
from kiln.serve.openai.tool_call_base import held_from_tag
from kiln.serve.openai.tool_output import ToolOutput, ToolStream

DEEPSEEK_R1, QWEN3 = "deepseek_r1", "qwen3"
REASONING_PARSERS = (DEEPSEEK_R1, QWEN3)
THINK, END_THINK = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    """An answer so far: its reasoning and the rest (the answer proper), each only what can no longer change."""
    reasoning: str
    answer: str


def prompt_opens_block(prompt: str) -> bool:
    """Whether a rendered chat prompt leaves its answer inside a `<think>` block (it ends with `<think>`)."""
    return prompt.rstrip().endswith(THINK)


def split(text: str, opened: bool, final: bool) -> Split:
    """Reasoning and answer of `text` (all of it when `final`; else what the text so far settles); `opened`: the
    prompt opened the block."""
    body = text.lstrip()
    if not final and THINK.startswith(body):
        return Split("", "")  # whitespace, or the start of <think>: it may still open the block, nothing is settled
    if body.startswith(THINK):
        body = body[len(THINK):]
    elif not opened:
        return Split("", text)
    end = body.find(END_THINK)
    if end < 0:
        reasoning = body if final else body[:held_from_tag(body, END_THINK)]
        return Split(reasoning.lstrip("\n"), "")
    return Split(body[:end].lstrip("\n"), body[end + len(END_THINK):].lstrip("\n"))


class ReasoningOutput:
    """How one request's chat answers are read with a reasoning parser: chat.py's answer interface (as ToolOutput's),
    the answer part handed to `tools` (a ToolOutput) when the request has tools. `opened`: the prompt opened the
    block (prompt_opens_block). A constrained answer (guided decoding, or a forced call) follows its grammar from
    the first token, so it holds no reasoning: it is read as the answer whole (`constrained`)."""

    def __init__(self, tools: ToolOutput | None, opened: bool, constrained: bool) -> None:
        self.tools = tools
        self.opened = opened
        self.constrained = constrained

    def split(self, text: str, final: bool) -> Split:
        return Split("", text) if self.constrained else split(text, self.opened, final)

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        return params

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """-> (the choice's `message`, its finish_reason)."""
        parts = self.split(text, final=True)
        if self.tools is not None:
            message, finish_reason = self.tools.message(parts.answer, finish_reason)
        else:
            message = {"role": "assistant", "content": parts.answer}
        if parts.reasoning:
            message = {**message, "content": message["content"] or None, "reasoning_content": parts.reasoning,
                       "reasoning": parts.reasoning}
        return message, finish_reason

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """One streamed choice: reasoning deltas as they settle, then the answer's (content or tool-call) deltas."""

    def __init__(self, output: ReasoningOutput) -> None:
        self.output = output
        self.reasoning_sent = 0
        self.answer = ToolStream(output.tools) if output.tools is not None else None
        self.content_sent = 0

    def deltas(self, text: str, finished: bool, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """-> (the `delta` objects to send now, in order; the finish_reason to send once finished)."""
        parts = self.output.split(text, final=finished)
        out: list[dict] = []
        reasoning = parts.reasoning[self.reasoning_sent:]
        if reasoning:
            out.append({"reasoning_content": reasoning, "reasoning": reasoning})
            self.reasoning_sent = len(parts.reasoning)
        if self.answer is not None:
            answer, finish_reason = self.answer.deltas(parts.answer, finished, finish_reason)
            return out + answer, finish_reason
        content = parts.answer[self.content_sent:]
        if content:
            out.append({"content": content})
            self.content_sent = len(parts.answer)
        return out, finish_reason
