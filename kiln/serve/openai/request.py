"""What both OpenAI endpoints share between a request body and kiln work: the `Job` a request becomes (one engine
request per choice: prompt i, choice j -> choice index i*n+j, and the functions that present what those requests
produce) and the checks of the fields both endpoints take (every invalid field is a 400 naming it; `n` and the
sequence count against the server's RequestLimits before anything is tokenized).

openai_completions.py and openai_chat.py build the jobs of /v1/completions and /v1/chat/completions;
openai_format.py makes OpenAI's objects; openai_api.py is the HTTP side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kiln.runtime import LoRARequest, Prompt
from kiln.runtime.core.outputs import RequestOutput
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.serve.beams import check_beam_width, max_beam_width
from kiln.serve.client_json import shown
from kiln.serve.engine_service import Delta, EngineService
from kiln.serve.errors import InvalidRequest
from kiln.serve.limits import RequestLimits
from kiln.serve.openai.format import usage as usage_object

# Structured output (guided_request.py), on both endpoints.
GUIDED_FIELDS = frozenset({"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                           "structured_outputs"})
# Fields whose OpenAI (or vLLM) name and meaning are SamplingParams' own.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                   "skip_special_tokens", "bad_words", "logit_bias")
# OpenAI's logit_bias range (a bias of -100 or 100 in effect bans or forces the token).
MAX_LOGIT_BIAS = 100
# vLLM's beam search: n beams, the n best returned as the choices (beam_search.py's fields).
BEAM_FIELDS = ("use_beam_search", "length_penalty", "early_stopping")
COMMON_FIELDS = frozenset({"model", "n", "stream", "stream_options", "user", "max_tokens",
                           "include_stop_str_in_output", *SAMPLING_FIELDS, *GUIDED_FIELDS, *BEAM_FIELDS})
# Unsupported fields are fine when null or empty, or at one of these values that ask for nothing.
_HARMLESS_VALUES = {"tool_choice": ["none"], "modalities": [["text"]],
                    "service_tier": ["auto", "default"], "parallel_tool_calls": [True, False], "store": [False]}


@dataclass(frozen=True)
class Choice:
    """One engine request of a response: choice `index`."""

    index: int
    prompt: Prompt
    params: SamplingParams
    counts_prompt: bool  # the first choice of its prompt (usage counts each prompt once, as OpenAI does)
    echo: str = ""  # text put before the completion (completions' `echo`)
    # completions' `max_tokens: 0` (with echo): the engine generates one token, which the answer leaves out
    drop_output: bool = False
    keep_stop: bool = False  # `include_stop_str_in_output`: the stop string that ended the text stays in it
    beams: int = 0  # beam search: the engine request's beams are choices index .. index + beams - 1


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
    # the field the output constraint came from (response_format, guided_json, tools, ...): an engine complaint
    # about the constraint names it
    guided_field: str | None = None
    lora_request: LoRARequest | None = None  # the LoRA adapter `model` selected (None: the base model)


# ---- checking a request ------------------------------------------------------------------------------
def check_fields(body: dict, supported: set[str], n: int) -> None:
    for name, value in body.items():
        if name in supported or value in (None, "", [], {}) or value in _HARMLESS_VALUES.get(name, []):
            continue
        if name == "best_of" and value == n:
            continue
        raise InvalidRequest(f"'{name}' is not supported by kiln serve (got {shown(value)})", name)


def check_model(body: dict, service: EngineService) -> LoRARequest | None:
    """The LoRA adapter the body's `model` selects (None: the base model, also when `model` is left out); a 404
    naming the served models when it is neither."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"model={shown(model)} is invalid: must be a string", "model")
    return service.loras.lookup(model)


@contextlib.contextmanager
def model_in_use(body: dict, service: EngineService) -> Iterator[LoRARequest | None]:
    """`check_model`, its adapter counted as in use until the block ends (`LoRAModules.using`): a request that
    resolved the adapter holds it through tokenizing, waiting and generating, so it cannot be unloaded under it."""
    with service.loras.using(check_model(body, service)) as lora:
        yield lora


def get_field(body: dict, name: str, default, kind: type | tuple[type, ...], rule: str):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidRequest(f"{name}={shown(value)} is invalid: must be {rule}", name)
    return value


def n_and_stream(body: dict, limits: RequestLimits) -> tuple[int, bool, bool]:
    """-> (n, stream, include_usage)."""
    n = get_field(body, "n", 1, int, f"an integer in [1, {limits.max_n}] (--max-n)")
    limits.check_n(n)
    stream = get_field(body, "stream", False, bool, "true or false")
    options = get_field(body, "stream_options", {}, dict, "an object such as {\"include_usage\": true}")
    if options and not stream:
        raise InvalidRequest("stream_options is only allowed with stream=true", "stream_options")
    include_usage = get_field(options, "include_usage", False, bool, "true or false")
    return n, stream, include_usage


def sampling_params(body: dict, field_names: dict[str, str], **fixed) -> SamplingParams:
    """SamplingParams from the request; `field_names` maps a SamplingParams field to the request's name."""
    kwargs = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    for name in ("stop", "stop_token_ids"):
        if name in kwargs and not isinstance(kwargs[name], (list, str) if name == "stop" else list):
            rule = "a string or a list of strings" if name == "stop" else "a list of token ids"
            raise InvalidRequest(f"{name}={shown(kwargs[name])} is invalid: must be {rule}", name)
    if not isinstance(kwargs.get("bad_words", []), list):
        raise InvalidRequest(f"bad_words={shown(kwargs['bad_words'])} is invalid: must be a list of strings",
                             "bad_words")
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = _logit_bias(kwargs["logit_bias"])
    try:
        return SamplingParams(**kwargs, **fixed)
    except ValueError as e:
        raise _openai_error(e, field_names) from None


def _logit_bias(value) -> dict[int, float]:
    """OpenAI's logit_bias, {"token id": bias in [-100, 100]} (JSON keys are strings) -> SamplingParams'."""
    rule = (f'an object mapping token ids to biases in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], such as '
            '{"50256": -100}')
    if not isinstance(value, dict):
        raise InvalidRequest(f"logit_bias={shown(value)} is invalid: must be {rule}", "logit_bias")
    bias = {}
    for key, v in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()) or isinstance(v, bool) \
                or not isinstance(v, (int, float)) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias entry {shown(key)}: {shown(v)} is invalid: must be {rule}",
                                 "logit_bias")
        bias[int(key)] = float(v)
    return bias


def _openai_error(e: ValueError, field_names: dict[str, str]) -> InvalidRequest:
    """SamplingParams' "SamplingParams.<field>=<value> is invalid: ..." with the request's field name."""
    message = str(e)
    field = message.removeprefix("SamplingParams.").split("=", 1)[0]
    param = field_names.get(field, field)
    return InvalidRequest(param + message.removeprefix(f"SamplingParams.{field}"), param)


def check_max_tokens(service: EngineService, max_tokens: int, field: str) -> None:
    if max_tokens >= service.max_seq_len:  # (with a prompt that fits, the engine says how much room is left)
        raise InvalidRequest(f"{field}={max_tokens} is invalid: must be below max_seq_len {service.max_seq_len}, "
                             "which also holds the prompt", field)


def seeded_choices(params: SamplingParams, n: int, field_names: dict[str, str]) -> list[SamplingParams]:
    """Choice j samples with seed + j: the choices differ, and each is reproducible."""
    if params.seed is None:
        return [params] * n
    try:
        return [dataclasses.replace(params, seed=params.seed + j) for j in range(n)]
    except ValueError as e:
        raise _openai_error(e, field_names) from None

def beam_search(body: dict, n: int, stream: bool, service: EngineService) -> dict:
    """vLLM's `use_beam_search` (with `length_penalty`, `early_stopping`) -> SamplingParams' beam-search fields
    ({} without it: `n` choices are then n requests sampled apart). The beam width is `n`, within the engine's
    max_beam_width; streaming is refused (as vLLM, which computes the beams and answers once)."""
    if not get_field(body, "use_beam_search", False, bool, "true or false"):
        return {}
    if stream:
        raise InvalidRequest("stream=true cannot be combined with use_beam_search=true: the beams are re-ranked "
                             "every step, so their text does not grow piece by piece; send stream=false",
                             "use_beam_search")
    check_beam_width(n, max_beam_width(service.llm), "n")
    early = body.get("early_stopping", False)
    if not (isinstance(early, bool) or early == "never"):
        raise InvalidRequest(f"early_stopping={shown(early)} is invalid: must be true, false or \"never\"",
                             "early_stopping")
    return dict(use_beam_search=True, n=n, early_stopping=early,
                length_penalty=get_field(body, "length_penalty", 1.0, (int, float), "a number"))


def expand_beams(choice: Choice, out: RequestOutput) -> list[tuple[Choice, RequestOutput]]:
    """A finished engine request's choices: itself, or each beam of a beam search as choice index + j (best
    first), presented as a plain output (its text, tokens, logprobs and finish reason)."""
    if not choice.beams or out.beam_outputs is None:
        return [(choice, out)]
    return [(dataclasses.replace(choice, index=choice.index + j, counts_prompt=choice.counts_prompt and j == 0),
             dataclasses.replace(out, text=beam.text, token_ids=list(beam.token_ids), logprobs=beam.logprobs,
                                 finish_reason=beam.finish_reason or out.finish_reason, top_logprobs=None,
                                 beam_outputs=None))
            for j, beam in enumerate(out.beam_outputs[:choice.beams])]


def usage(choices: list[Choice], outputs: dict[int, RequestOutput]) -> dict:
    prompt = sum(len(outputs[c.index].prompt_token_ids) for c in choices if c.counts_prompt)
    completion = sum(len(outputs[c.index].token_ids) for c in choices if not c.drop_output)
    cached = sum(outputs[c.index].num_cached_tokens for c in choices if c.counts_prompt)
    return usage_object(prompt, completion, cached)



def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
