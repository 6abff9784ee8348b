"""/v1/chat/completions: checking the messages, rendering the chat template, and presenting the choices.
`chat_messages` and `chat_prompt` also serve /tokenize.

With `tools`, the template renders them (transformers' `apply_chat_template(..., tools=...)`); tool_choice
"auto" reads the answer for tool calls, "required" and a named function constrain it to one call
(tool_specs.py checks the fields, tool_calls.py reads and constrains the model's format, openai_tool_output.py
presents the calls). GPT-OSS's harmony format is read from every answer, tools or not (harmony.py: reasoning,
content, calls). `response_format` and vLLM's guided_* fields constrain the text (guided_request.py).
"""

from __future__ import annotations

from pathlib import Path

from kiln.runtime.core.outputs import RequestOutput
from kiln.runtime.core.sampling_params import MAX_TOP_LOGPROBS
from kiln.serve.client_json import check_values, shown
from kiln.serve.config import ServeConfig
from kiln.serve.engine_service import Delta, EngineService
from kiln.serve.errors import InvalidRequest
from kiln.serve.guided_request import openai_guided
from kiln.serve.limits import RequestLimits
from kiln.serve.openai import request as common
from kiln.serve.openai.format import chat_logprobs, stop_string
from kiln.serve.openai.harmony import HarmonyOutput, HarmonyStream
from kiln.serve.openai.reasoning import ReasoningOutput, ReasoningStream, prompt_opens_block
from kiln.serve.openai.request import Choice, Job
from kiln.serve.openai.tool_calls import HARMONY, PARSERS, default_parser
from kiln.serve.openai.tool_output import ToolOutput, ToolStream
from kiln.serve.openai.tool_specs import (
    ToolChoice,
    check_tool_choice,
    check_tools,
    template_tool_calls,
    with_text_arguments,
)

_CHAT_FIELDS = common.COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                       "tool_choice", "chat_template_kwargs", "reasoning_effort"}
# OpenAI's reasoning_effort values; the chat template reads the one given as `reasoning_effort` (GPT-OSS's does).
_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# apply_chat_template's own arguments, and what kiln passes itself: not for chat_template_kwargs to set.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                       "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                       "truncation", "max_length", "return_tensors", "return_dict",
                                       "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})


def tool_call_parser(config: ServeConfig, service: EngineService) -> str:
    """--tool-call-parser, else the format of the engine's architecture or of the chat template it serves."""
    template = config.chat_template or getattr(service.tokenizer, "chat_template", None)
    return config.tool_call_parser or default_parser(service.llm.architecture,
                                                     template if isinstance(template, str) else None)


def chat_reading(config: ServeConfig, service: EngineService) -> str:
    """How chat answers are read, for the startup line: the tool-call format and where it comes from, and
    whether a reasoning parser reads the <think> block."""
    parser = tool_call_parser(config, service)
    source = "--tool-call-parser" if config.tool_call_parser else f"the default for {service.llm.architecture}"
    if parser == HARMONY:
        return f"harmony channels: reasoning, content, tool calls ({source})"
    reasoning = (f"<think> into reasoning_content (--reasoning-parser {config.reasoning_parser})"
                 if config.reasoning_parser else "answers as written (--reasoning-parser reads <think>)")
    return f"tool calls in {parser} ({source}); {reasoning}"


def answer_output(parser: str, tool_choice: ToolChoice, tokenizer) -> ToolOutput | HarmonyOutput | None:
    """How a request's answers are read: harmony's channels always (and its calls with tools), another format's
    calls only with tools, else not at all (plain text)."""
    if parser == HARMONY:
        return HarmonyOutput(tokenizer, tool_choice)
    return ToolOutput(PARSERS[parser], tool_choice) if tool_choice.tools else None


def with_reasoning(output, reasoning_parser: str | None, prompt: str, constrained: bool):
    """`output` read after reasoning.py's split, where a reasoning parser is set (`prompt`: the rendered prompt,
    which may open the <think> block); harmony reads its own reasoning channel."""
    if reasoning_parser is None or isinstance(output, HarmonyOutput):
        return output
    return ReasoningOutput(output, prompt_opens_block(prompt), constrained)


def template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs` (vLLM's field: extra variables for the chat template, e.g. Qwen3's
    `{"enable_thinking": false}`), checked: an object of named values that are not apply_chat_template's own."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise InvalidRequest(f"chat_template_kwargs={shown(kwargs)} is invalid: must be an object of template "
                             "variables (names as keys)", "chat_template_kwargs")
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields "
                             "and the server decide those", "chat_template_kwargs")
    return kwargs


def chat_template_variables(body: dict) -> dict:
    """The template's extra variables: chat_template_kwargs, and OpenAI's `reasoning_effort` as the variable of that
    name (GPT-OSS's template puts it in the system message; vLLM passes it the same way)."""
    kwargs = template_kwargs(body)
    effort = body.get("reasoning_effort")
    if effort is None:
        return kwargs
    if effort not in _REASONING_EFFORTS:
        raise InvalidRequest(f"reasoning_effort={shown(effort)} is invalid: must be one of "
                             f"{', '.join(_REASONING_EFFORTS)}", "reasoning_effort")
    if kwargs.get("reasoning_effort", effort) != effort:
        raise InvalidRequest(f"reasoning_effort={effort!r} and chat_template_kwargs.reasoning_effort="
                             f"{shown(kwargs['reasoning_effort'])} disagree: send one", "reasoning_effort")
    return {**kwargs, "reasoning_effort": effort}


def chat_messages(messages) -> list[dict]:
    """Checks the messages; content given as text parts is joined into one string for the template."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects",
                             "messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
            raise InvalidRequest(f"messages[{i}] must be an object with a 'role' string and 'content'", "messages")
        content = message.get("content")
        tool_calls = template_tool_calls(message, i)
        if tool_calls is not None:  # an assistant turn that called tools may have no content
            message = {**message, "tool_calls": tool_calls}
            content = "" if content is None else content
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if isinstance(reasoning, str) and "thinking" not in message:  # GPT-OSS's template calls it `thinking`
            message = {**message, "thinking": reasoning}
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidRequest(f"messages[{i}].content: only {{\"type\": \"text\", \"text\": ...}} parts are "
                                     "supported", "messages")
            content = "\n".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
        checked.append({**message, "content": content})
    return checked


def check_messages_size(service: EngineService, limits: RequestLimits, messages: list[dict]) -> int:
    """The checked messages' content, all together, against --max-prompt-chars before the template renders it
    -> its size in characters."""
    size = sum(len(message["content"]) for message in messages)
    limits.check_prompt_chars("the messages' content", size, "messages", service.max_seq_len)
    return size


def chat_prompt(service: EngineService, chat_template: str | None, messages: list[dict],
                add_generation_prompt: bool = True, tools: list[dict] | None = None,
                kwargs: dict | None = None) -> list[int]:
    """chat_text's prompt tokenized. Slow for long messages: run it on the service's prompt worker."""
    return prompt_ids(service, chat_text(service, chat_template, messages, add_generation_prompt, tools, kwargs))


def prompt_ids(service: EngineService, text: str) -> list[int]:
    """A rendered chat prompt's token ids, with the BOS token only if the template did not write it."""
    bos = service.tokenizer.bos_token
    return list(service.tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos))))


def chat_text(service: EngineService, chat_template: str | None, messages: list[dict],
              add_generation_prompt: bool = True, tools: list[dict] | None = None,
              kwargs: dict | None = None) -> str:
    """Renders the chat template (with `tools`, the request's tool objects, when given, and `kwargs`, its
    chat_template_kwargs)."""
    tokenizer = service.tokenizer
    if tokenizer is None:
        raise InvalidRequest("this engine has no tokenizer, so it cannot serve chat; use /v1/completions with "
                             "token ids", "messages")
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise InvalidRequest(f"model '{service.model_name}' has no chat template; start the server with "
                             "`kiln serve --chat-template FILE` (a Jinja template) or use /v1/completions",
                             "messages")

    def render(messages: list[dict]) -> str:
        try:
            return tokenizer.apply_chat_template(messages, chat_template=chat_template, tools=tools or None,
                                                 add_generation_prompt=add_generation_prompt, tokenize=False,
                                                 **(kwargs or {}))
        except Exception as e:  # a template may reject any message (jinja's raise_exception, a missing key, ...)
            raise InvalidRequest(f"the chat template cannot render these messages: {e}", "messages") from None

    try:
        return render(messages)
    except InvalidRequest:
        # Earlier calls' arguments go in as objects (Llama's and Qwen's templates); a template that adds them to a
        # string (DeepSeek's: '...' + tool['function']['arguments']) fails on that and takes their JSON text.
        as_text = with_text_arguments(messages)
        if as_text is None:
            raise
        return render(as_text)


def chat_template_source(config: ServeConfig, tokenizer) -> str:
    """Which template /v1/chat/completions renders, for the startup line: the --chat-template file, the engine's
    own (copied from the checkpoint's tokenizer files by `kiln build`), or none (chat is off, and the flag that
    turns it on)."""
    if tokenizer is None:
        return "none: this engine has no tokenizer, so it cannot serve chat (/v1/completions takes token ids)"
    if config.chat_template:
        return f"the file given by --chat-template ({config.chat_template_file or 'ServeConfig.chat_template'})"
    if getattr(tokenizer, "chat_template", None):
        folder = Path(config.engine_dir) / "tokenizer"
        where = next((f"tokenizer/{name}" for name in ("chat_template.jinja", "chat_template.json",
                                                       "tokenizer_config.json") if (folder / name).is_file()), None)
        return f"the engine's own ({where})" if where else "the engine's own"
    return ("none: /v1/chat/completions answers 400 until the server is started with `--chat-template FILE` (a "
            "Jinja template)")


def _max_chat_tokens(service: EngineService, num_prompt_tokens: int) -> int:
    """The default: as much as fits in both the sequence limit and the KV cache."""
    stats = service.llm.kv_cache_stats()
    room = min(service.max_seq_len, stats["total_blocks"] * stats["block_size"]) - num_prompt_tokens
    if room < 1:
        raise InvalidRequest(f"the messages take {num_prompt_tokens} tokens, leaving no room for a reply within "
                             f"max_seq_len {service.max_seq_len}", "messages")
    return room


def _constraint(body: dict, tool_choice: ToolChoice, output: ToolOutput | HarmonyOutput | None):
    """-> (the output's GuidedDecoding or None, the field it comes from)."""
    guided, field = openai_guided(body)
    if not tool_choice.constrained:
        return guided, field
    if guided is not None:
        which = repr(tool_choice.mode) if tool_choice.mode == "required" else f"naming {tool_choice.tools[0].name!r}"
        raise InvalidRequest(f"{field} cannot be combined with tool_choice {which}, which constrains the answer to "
                             "a tool call", field)
    return output.constraint(), "tools"


async def chat_job(service: EngineService, body: dict, chat_template: str | None, limits: RequestLimits,
                   tool_call_parser: str = "llama3_json", reasoning_parser: str | None = None) -> Job:
    """Checks the request; the template is rendered and tokenized on the service's prompt worker, never on the
    event loop, once the messages' size is within --max-prompt-chars."""
    n, stream, include_usage = common.n_and_stream(body, limits)
    limits.check_sequences(1, n)
    check_values(body)
    common.check_fields(body, _CHAT_FIELDS, n)
    tools = check_tools(body.get("tools"))
    tool_choice = check_tool_choice(body.get("tool_choice"), tools)
    output = answer_output(tool_call_parser, tool_choice, service.tokenizer)
    guided, guided_field = _constraint(body, tool_choice, output)
    kwargs = chat_template_variables(body)
    count_tokens = limits.prompt_tokens(service.tokenize, "messages")
    messages = chat_messages(body.get("messages"))
    size = check_messages_size(service, limits, messages)

    def render() -> tuple[list[int], str]:
        text = chat_text(service, chat_template, messages, tools=[t.spec for t in tools], kwargs=kwargs)
        return count_tokens(prompt_ids(service, text)), text

    token_ids, prompt = await service.run_prompt_work(render, size=size)
    output = with_reasoning(output, reasoning_parser, prompt, constrained=guided is not None)
    limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = common.get_field(body, limit_field, None, int, "an integer >= 1")
    if max_tokens is None:
        max_tokens = _max_chat_tokens(service, len(token_ids))
    else:
        common.check_max_tokens(service, max_tokens, limit_field)
    want_logprobs = common.get_field(body, "logprobs", False, bool, "true or false")
    keep_stop = common.get_field(body, "include_stop_str_in_output", False, bool, "true or false")
    names = {"max_tokens": limit_field, "logprobs": "logprobs", "top_logprobs": "top_logprobs"}
    top_logprobs = common.get_field(body, "top_logprobs", 0, int, f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    beams = common.beam_search(body, n, stream, service)  # {} unless use_beam_search
    params = common.sampling_params(body, names, max_tokens=max_tokens, logprobs=want_logprobs,
                                    top_logprobs=top_logprobs, guided_decoding=guided, **beams)
    if output is not None:
        params = output.sampling_params(params)
    if beams:  # one engine request whose n beams are the n choices
        choices = [Choice(0, token_ids, params, True, keep_stop=keep_stop, beams=n)]
    else:
        choices = [Choice(j, token_ids, p, j == 0, keep_stop=keep_stop)
                   for j, p in enumerate(common.seeded_choices(params, n, names))]
    tokenizer = service.tokenizer
    eos = service.llm.eos_token_ids

    def logprobs(token_ids, lps, tops) -> dict | None:
        return chat_logprobs(tokenizer, token_ids, lps, tops) if want_logprobs else None

    def text_of(choice: Choice, out: RequestOutput, text: str) -> str:
        return text + stop_string(tokenizer, choice.params, eos, out) if choice.keep_stop and out.finished else text

    answer_streams: dict[int, ToolStream | HarmonyStream | ReasoningStream] = {}

    def format_choice(choice: Choice, out: RequestOutput) -> dict:
        text = text_of(choice, out, out.text)
        message, finish_reason = {"role": "assistant", "content": text}, out.finish_reason
        if output is not None:
            message, finish_reason = output.message(text, finish_reason)
        return {"index": choice.index, "message": message, "finish_reason": finish_reason,
                "logprobs": logprobs(out.token_ids, out.logprobs, out.top_logprobs)}

    def format_delta(choice: Choice, delta: Delta, first: bool) -> list[dict]:
        pieces = []
        if first:
            pieces.append({"index": choice.index, "delta": {"role": "assistant", "content": ""},
                           "finish_reason": None, "logprobs": None})
        lps = logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs)
        text, finish_reason = text_of(choice, delta.output, delta.text), delta.finish_reason
        deltas = [{"content": text}] if text else []
        if output is not None:  # the deltas come from the text so far (held back where a marker or call may be)
            stream_state = answer_streams.setdefault(choice.index, output.stream())
            full = text_of(choice, delta.output, delta.output.text)
            deltas, finish_reason = stream_state.deltas(full, delta.finished, delta.finish_reason)
            if delta.finished:
                answer_streams.pop(choice.index, None)
        calls = any("tool_calls" in d for d in deltas)
        if not deltas or "tool_calls" in deltas[0]:
            if lps and lps["content"] or (delta.finished and not calls):
                deltas.insert(0, {})
        for k, d in enumerate(deltas):  # logprobs ride on the first, the finish reason on the last
            last = k == len(deltas) - 1 and "tool_calls" not in d
            pieces.append({"index": choice.index, "delta": d, "finish_reason": finish_reason if last else None,
                           "logprobs": lps if k == 0 else None})
        if deltas and "tool_calls" in deltas[-1]:  # the finish reason comes after the calls, as OpenAI sends it
            pieces.append({"index": choice.index, "delta": {}, "finish_reason": finish_reason, "logprobs": None})
        return pieces

    return Job(common.new_id("chatcmpl"), choices, stream, include_usage, "messages", "chat.completion",
               "chat.completion.chunk", format_choice, format_delta, service.model_name, guided_field=guided_field)


