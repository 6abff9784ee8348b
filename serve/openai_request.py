"""Turning an OpenAI request body into kiln work, and kiln's results into OpenAI's objects.

`completion_job` and `chat_job` check a /v1/completions or /v1/chat/completions body (every invalid field is a
400 naming it) and return a `Job`: one engine request per choice (prompt i, choice j -> choice index i*n+j) and
the functions that present what those requests produce. The request's size (prompts, n, prompts × n, prompt
tokens) is checked against the server's RequestLimits before anything is tokenized, and prompts are tokenized
here, counting their tokens. Nothing here speaks HTTP; openai_api.py does.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kiln.runtime.engine import Prompt
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

from .client_json import check_values, shown
from .engine_service import Delta, EngineService
from .errors import InvalidRequest, NotFound
from .limits import RequestLimits

# Fields whose OpenAI (or vLLM) name and meaning are SamplingParams' own.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos")
_COMMON_FIELDS = {"model", "n", "stream", "stream_options", "user", "max_tokens", *_SAMPLING_FIELDS}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
# Unsupported fields are fine when null or empty, or at one of these values that ask for nothing.
_HARMLESS_VALUES = {"response_format": [{"type": "text"}], "tool_choice": ["none"], "modalities": [["text"]],
                    "service_tier": ["auto", "default"], "parallel_tool_calls": [True, False], "store": [False]}
MAX_COMPLETION_LOGPROBS = 5


@dataclass(frozen=True)
class Choice:
    """One engine request of a response: choice `index`."""

    index: int
    prompt: Prompt
    params: SamplingParams
    counts_prompt: bool  # the first choice of its prompt (usage counts each prompt once, as OpenAI does)
    echo: str = ""  # text put before the completion (completions' `echo`)


@dataclass(frozen=True)
class Job:
    """A checked request: its engine requests and how to present what they produce."""

    id: str
    choices: list[Choice]
    stream: bool
    include_usage: bool
    prompt_field: str  # the field that engine complaints about a prompt point at
    object: str
    chunk_object: str
    # a finished choice as it appears in the whole answer
    format_choice: Callable[[Choice, RequestOutput], dict]
    # streamed choice objects for one delta; the bool says it is the choice's first
    format_delta: Callable[[Choice, Delta, bool], list[dict]]
    model: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


# ---- checking a request ------------------------------------------------------------------------------
def _check_fields(body: dict, supported: set[str], n: int) -> None:
    for name, value in body.items():
        if name in supported or value in (None, "", [], {}) or value in _HARMLESS_VALUES.get(name, []):
            continue
        if name == "best_of" and value == n:
            continue
        raise InvalidRequest(f"'{name}' is not supported by kiln serve (got {shown(value)})", name)


def check_model(body: dict, service: EngineService) -> None:
    model = body.get("model")
    if model is not None and model != service.model_name:
        raise NotFound(f"The model '{model}' does not exist; this server serves '{service.model_name}'", "model")


def _get(body: dict, name: str, default, kind: type | tuple[type, ...], rule: str):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidRequest(f"{name}={shown(value)} is invalid: must be {rule}", name)
    return value


def _n_and_stream(body: dict, limits: RequestLimits) -> tuple[int, bool, bool]:
    """-> (n, stream, include_usage)."""
    n = _get(body, "n", 1, int, f"an integer in [1, {limits.max_n}] (--max-n)")
    limits.check_n(n)
    stream = _get(body, "stream", False, bool, "true or false")
    options = _get(body, "stream_options", {}, dict, "an object such as {\"include_usage\": true}")
    if options and not stream:
        raise InvalidRequest("stream_options is only allowed with stream=true", "stream_options")
    include_usage = _get(options, "include_usage", False, bool, "true or false")
    return n, stream, include_usage


def _sampling_params(body: dict, field_names: dict[str, str], **fixed) -> SamplingParams:
    """SamplingParams from the request; `field_names` maps a SamplingParams field to the request's name."""
    kwargs = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    for name in ("stop", "stop_token_ids"):
        if name in kwargs and not isinstance(kwargs[name], (list, str) if name == "stop" else list):
            rule = "a string or a list of strings" if name == "stop" else "a list of token ids"
            raise InvalidRequest(f"{name}={shown(kwargs[name])} is invalid: must be {rule}", name)
    try:
        return SamplingParams(**kwargs, **fixed)
    except ValueError as e:
        raise _openai_error(e, field_names) from None


def _openai_error(e: ValueError, field_names: dict[str, str]) -> InvalidRequest:
    """SamplingParams' "SamplingParams.<field>=<value> is invalid: ..." with the request's field name."""
    message = str(e)
    field = message.removeprefix("SamplingParams.").split("=", 1)[0]
    param = field_names.get(field, field)
    return InvalidRequest(param + message.removeprefix(f"SamplingParams.{field}"), param)


def _check_max_tokens(service: EngineService, max_tokens: int, field: str) -> None:
    if max_tokens >= service.max_seq_len:  # (with a prompt that fits, the engine says how much room is left)
        raise InvalidRequest(f"{field}={max_tokens} is invalid: must be below max_seq_len {service.max_seq_len}, "
                             "which also holds the prompt", field)


def _seeded_choices(params: SamplingParams, n: int, field_names: dict[str, str]) -> list[SamplingParams]:
    """Choice j samples with seed + j: the choices differ, and each is reproducible."""
    if params.seed is None:
        return [params] * n
    try:
        return [dataclasses.replace(params, seed=params.seed + j) for j in range(n)]
    except ValueError as e:
        raise _openai_error(e, field_names) from None


def _prompt_count(prompt) -> int:
    """How many prompts `prompt` holds, without looking past its first element (a list of strings or of lists
    is that many prompts; anything else is one, or invalid, which _completion_prompts says)."""
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1


def _completion_prompts(prompt) -> list[Prompt]:
    """A string, a list of strings, a list of token ids or a list of lists of token ids -> the prompts."""
    def is_tokens(p):
        return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    if isinstance(prompt, str) or (is_tokens(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_tokens(p) for p in prompt):
        prompts = prompt
    else:
        raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids or a list of lists "
                             "of token ids", "prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise InvalidRequest(f"prompt {i} is empty", "prompt")
    return prompts


def _chat_messages(messages) -> list[dict]:
    """Checks the messages; content given as text parts is joined into one string for the template."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects",
                             "messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
            raise InvalidRequest(f"messages[{i}] must be an object with a 'role' string and 'content'", "messages")
        content = message.get("content")
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


def _chat_prompt(service: EngineService, chat_template: str | None, messages: list[dict]) -> list[int]:
    """Renders the chat template and tokenizes it, adding the BOS token only if the template did not."""
    tokenizer = service.tokenizer
    if tokenizer is None:
        raise InvalidRequest("this engine has no tokenizer, so it cannot serve chat; use /v1/completions with "
                             "token ids", "messages")
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise InvalidRequest(f"model '{service.model_name}' has no chat template; start the server with "
                             "`kiln serve --chat-template FILE` (a Jinja template) or use /v1/completions",
                             "messages")
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=chat_template, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as e:  # a template may reject any message (jinja's raise_exception, a missing key, ...)
        raise InvalidRequest(f"the chat template cannot render these messages: {e}", "messages") from None
    bos = tokenizer.bos_token
    return list(tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos))))


def _max_chat_tokens(service: EngineService, num_prompt_tokens: int) -> int:
    """The default: as much as fits in both the sequence limit and the KV cache."""
    stats = service.llm.kv_cache_stats()
    room = min(service.max_seq_len, stats["total_blocks"] * stats["block_size"]) - num_prompt_tokens
    if room < 1:
        raise InvalidRequest(f"the messages take {num_prompt_tokens} tokens, leaving no room for a reply within "
                             f"max_seq_len {service.max_seq_len}", "messages")
    return room


# ---- presenting results --------------------------------------------------------------------------------
def _decode(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids) if tokenizer is not None else ""


def _top(tokenizer, alternatives: dict[int, float]) -> list[tuple[str, float]]:
    ranked = sorted(alternatives.items(), key=lambda item: -item[1])
    return [(_decode(tokenizer, [t]), lp) for t, lp in ranked]


def _completion_logprobs(tokenizer, token_ids, logprobs, top_logprobs, offset: int) -> dict:
    """OpenAI's legacy logprobs object; `offset` is where the first token starts in the choice's text. Each
    top_logprobs entry holds the requested alternatives and the chosen token."""
    tokens = [_decode(tokenizer, [t]) for t in token_ids]
    offsets, tops = [], []
    for i, token in enumerate(tokens):
        offsets.append(offset)
        offset += len(token)
        top = dict(_top(tokenizer, top_logprobs[i])) if top_logprobs else {}
        top.setdefault(token, logprobs[i])
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(tokenizer, token_ids, logprobs, top_logprobs) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = []
    for i, token_id in enumerate(token_ids):
        item = entry(_decode(tokenizer, [token_id]), logprobs[i])
        item["top_logprobs"] = [entry(t, lp) for t, lp in _top(tokenizer, top_logprobs[i])] if top_logprobs else []
        content.append(item)
    return {"content": content}


def usage(choices: list[Choice], outputs: dict[int, RequestOutput]) -> dict:
    prompt = sum(len(outputs[c.index].prompt_token_ids) for c in choices if c.counts_prompt)
    completion = sum(len(o.token_ids) for o in outputs.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ---- building a job ------------------------------------------------------------------------------------
def completion_job(service: EngineService, body: dict, limits: RequestLimits) -> Job:
    n, stream, include_usage = _n_and_stream(body, limits)
    count = _prompt_count(body.get("prompt"))
    limits.check_prompts(count)
    limits.check_sequences(count, n)
    check_values(body)
    _check_fields(body, _COMPLETION_FIELDS, n)
    prompts = _completion_prompts(body.get("prompt"))
    k = _get(body, "logprobs", None, int, f"an integer in [0, {MAX_COMPLETION_LOGPROBS}]")
    if k is not None and not 0 <= k <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequest(f"logprobs={k} is invalid: must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]",
                             "logprobs")
    echo = _get(body, "echo", False, bool, "true or false")
    if echo and k is not None:
        raise InvalidRequest("echo with logprobs is not supported", "echo")
    names = {"top_logprobs": "logprobs"}
    params = _sampling_params(body, names, max_tokens=_get(body, "max_tokens", 16, int, "an integer >= 1"),
                              logprobs=k is not None, top_logprobs=k or 0)
    _check_max_tokens(service, params.max_tokens, "max_tokens")
    tokenizer = service.tokenizer
    tokenize = limits.prompt_tokens(service.llm.engine.tokenize, "prompt")
    choices = []
    for i, prompt in enumerate(prompts):
        token_ids = tokenize(prompt)
        echoed = "" if not echo else prompt if isinstance(prompt, str) else _decode(tokenizer, prompt)
        for j, choice_params in enumerate(_seeded_choices(params, n, names)):
            choices.append(Choice(i * n + j, token_ids, choice_params, j == 0, echoed))
    offsets: dict[int, int] = {}  # streamed text so far per choice, for text_offset

    def logprobs(token_ids, lps, tops, offset: int) -> dict | None:
        return None if k is None else _completion_logprobs(tokenizer, token_ids, lps, tops, offset)

    def format_choice(choice: Choice, out: RequestOutput) -> dict:
        return {"index": choice.index, "text": choice.echo + out.text, "finish_reason": out.finish_reason,
                "logprobs": logprobs(out.token_ids, out.logprobs, out.top_logprobs, len(choice.echo))}

    def format_delta(choice: Choice, delta: Delta, first: bool) -> list[dict]:
        text = (choice.echo if first else "") + delta.text
        lps = logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs, offsets.get(choice.index, 0))
        if lps is not None:
            offsets[choice.index] = offsets.get(choice.index, 0) + sum(len(t) for t in lps["tokens"])
        if not (text or lps and lps["tokens"] or delta.finished):
            return []
        return [{"index": choice.index, "text": text, "finish_reason": delta.finish_reason, "logprobs": lps}]

    return Job(_new_id("cmpl"), choices, stream, include_usage, "prompt", "text_completion", "text_completion",
                format_choice, format_delta, service.model_name)


def chat_job(service: EngineService, body: dict, chat_template: str | None, limits: RequestLimits) -> Job:
    n, stream, include_usage = _n_and_stream(body, limits)
    limits.check_sequences(1, n)
    check_values(body)
    _check_fields(body, _CHAT_FIELDS, n)
    count_tokens = limits.prompt_tokens(service.llm.engine.tokenize, "messages")
    token_ids = count_tokens(_chat_prompt(service, chat_template, _chat_messages(body.get("messages"))))
    limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, limit_field, None, int, "an integer >= 1")
    if max_tokens is None:
        max_tokens = _max_chat_tokens(service, len(token_ids))
    else:
        _check_max_tokens(service, max_tokens, limit_field)
    want_logprobs = _get(body, "logprobs", False, bool, "true or false")
    names = {"max_tokens": limit_field, "logprobs": "logprobs", "top_logprobs": "top_logprobs"}
    top_logprobs = _get(body, "top_logprobs", 0, int, f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    params = _sampling_params(body, names, max_tokens=max_tokens, logprobs=want_logprobs, top_logprobs=top_logprobs)
    choices = [Choice(j, token_ids, p, j == 0) for j, p in enumerate(_seeded_choices(params, n, names))]
    tokenizer = service.tokenizer

    def logprobs(token_ids, lps, tops) -> dict | None:
        return _chat_logprobs(tokenizer, token_ids, lps, tops) if want_logprobs else None

    def format_choice(choice: Choice, out: RequestOutput) -> dict:
        return {"index": choice.index, "message": {"role": "assistant", "content": out.text},
                "finish_reason": out.finish_reason,
                "logprobs": logprobs(out.token_ids, out.logprobs, out.top_logprobs)}

    def format_delta(choice: Choice, delta: Delta, first: bool) -> list[dict]:
        pieces = []
        if first:
            pieces.append({"index": choice.index, "delta": {"role": "assistant", "content": ""},
                           "finish_reason": None, "logprobs": None})
        lps = logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs)
        if delta.text or lps and lps["content"] or delta.finished:
            pieces.append({"index": choice.index, "delta": {"content": delta.text} if delta.text else {},
                           "finish_reason": delta.finish_reason, "logprobs": lps})
        return pieces

    return Job(_new_id("chatcmpl"), choices, stream, include_usage, "messages", "chat.completion",
                "chat.completion.chunk", format_choice, format_delta, service.model_name)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
