"""/v1/completions: checking a request body and presenting its choices, `echo` and `logprobs` included.
`response_format` and vLLM's guided_* fields constrain the generated text (guided_request.py).

A prompt is a string, a list of strings, token ids or lists of token ids. With `echo` the choice's text starts with
the prompt, and with `logprobs` too its logprobs object covers the prompt's tokens (none for the first) before the
generated ones, as vLLM's does; `max_tokens: 0` (only with `echo`) returns the prompt and generates nothing.
"""

from __future__ import annotations

from kiln.runtime import Prompt
from kiln.runtime.core.outputs import RequestOutput
from kiln.serve.client_json import check_values, shown
from kiln.serve.engine_service import Delta, EngineService
from kiln.serve.errors import InvalidRequest
from kiln.serve.guided_request import openai_guided
from kiln.serve.limits import RequestLimits
from kiln.serve.openai.format import CompletionLogprobs, decode, joined, stop_string
from kiln.serve.openai.request import (
    COMMON_FIELDS,
    Choice,
    Job,
    beam_search,
    check_fields,
    check_max_tokens,
    get_field,
    n_and_stream,
    new_id,
    sampling_params,
    seeded_choices,
)

_COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo"}
MAX_COMPLETION_LOGPROBS = 5


def prompt_count(prompt) -> int:
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


def _completion_max_tokens(body: dict, echo: bool) -> int:
    """`max_tokens` (16); 0 only with echo, as vLLM allows: the prompt comes back and nothing is generated."""
    max_tokens = get_field(body, "max_tokens", 16, int, "an integer >= 1 (or 0 with echo=true)")
    if max_tokens == 0:
        if not echo:
            raise InvalidRequest("max_tokens=0 is only allowed with echo=true (then the prompt comes back and "
                                 "nothing is generated)", "max_tokens")
        if body.get("min_tokens"):
            raise InvalidRequest(f"min_tokens={shown(body['min_tokens'])} is invalid: must be at most "
                                 "max_tokens=0", "min_tokens")
    return max_tokens


async def completion_job(service: EngineService, body: dict, limits: RequestLimits) -> Job:
    """Checks the request and tokenizes its prompts on the service's prompt worker (never on the event loop),
    after checking each text prompt's size against --max-prompt-chars."""
    n, stream, include_usage = n_and_stream(body, limits)
    count = prompt_count(body.get("prompt"))
    limits.check_prompts(count)
    limits.check_sequences(count, n)
    check_values(body)
    check_fields(body, _COMPLETION_FIELDS, n)
    prompts = _completion_prompts(body.get("prompt"))
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            limits.check_prompt_chars(f"prompt {i}" if len(prompts) > 1 else "prompt", len(prompt), "prompt",
                                      service.max_seq_len)
    k = get_field(body, "logprobs", None, int, f"an integer in [0, {MAX_COMPLETION_LOGPROBS}]")
    if k is not None and not 0 <= k <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequest(f"logprobs={k} is invalid: must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]",
                             "logprobs")
    echo = get_field(body, "echo", False, bool, "true or false")
    keep_stop = get_field(body, "include_stop_str_in_output", False, bool, "true or false")
    max_tokens = _completion_max_tokens(body, echo)
    names = {"top_logprobs": "logprobs", "prompt_top_logprobs": "logprobs"}
    echo_logprobs = echo and k is not None  # the prompt's tokens get logprobs too
    guided, guided_field = openai_guided(body)
    beams = beam_search(body, n, stream, service)  # {} unless use_beam_search
    params = sampling_params(body, names, max_tokens=max(max_tokens, 1), logprobs=k is not None,
                             top_logprobs=k or 0, prompt_logprobs=echo_logprobs,
                             prompt_top_logprobs=k if echo_logprobs else 0, guided_decoding=guided, **beams)
    check_max_tokens(service, params.max_tokens, "max_tokens")
    tokenizer = service.tokenizer
    tokenize = limits.prompt_tokens(service.tokenize, "prompt")

    def tokenize_all() -> list[tuple[list[int], str]]:
        """On the prompt worker: each prompt's token ids and echoed text, in order (the token limit counts them
        as they come)."""
        prepared = []
        for i, prompt in enumerate(prompts):
            token_ids = tokenize(prompt)
            if max_tokens == 0 and len(token_ids) >= service.max_seq_len:
                raise InvalidRequest(f"prompt {i} has {len(token_ids)} tokens; with max_tokens=0 the engine still "
                                     f"computes one token after it, so at most {service.max_seq_len - 1} fit in "
                                     f"max_seq_len {service.max_seq_len}", "prompt")
            prepared.append((token_ids, "" if not echo else prompt if isinstance(prompt, str)
                             else decode(tokenizer, prompt)))
        return prepared

    prepared = await service.run_prompt_work(tokenize_all, size=sum(len(prompt) for prompt in prompts))
    choices = []
    for i, (token_ids, echoed) in enumerate(prepared):
        if beams:  # one engine request whose n beams are the prompt's n choices
            choices.append(Choice(i * n, token_ids, params, True, echoed, max_tokens == 0, keep_stop, beams=n))
            continue
        for j, choice_params in enumerate(seeded_choices(params, n, names)):
            choices.append(Choice(i * n + j, token_ids, choice_params, j == 0, echoed, max_tokens == 0, keep_stop))
    builders: dict[int, CompletionLogprobs] = {}  # per choice, while it streams
    eos = service.llm.eos_token_ids

    def text_and_logprobs(choice: Choice, out: RequestOutput, text: str, token_ids, lps, tops, first: bool):
        """What a piece of a choice adds: its text and its logprobs object (None unless asked); `first`: the
        choice's first piece, which holds the echo."""
        if choice.drop_output:
            text, token_ids, lps, tops = "", [], [], []
        text = (choice.echo if first else "") + text
        if out.finished and choice.keep_stop and not choice.drop_output:
            text += stop_string(tokenizer, choice.params, eos, out)
        if k is None:
            return text, None
        if first:
            builders[choice.index] = CompletionLogprobs(tokenizer)
        builder = builders[choice.index]
        prompt = builder.prompt(out) if first and echo else None
        new = builder.piece(token_ids, lps, tops)
        if out.finished:
            builders.pop(choice.index, None)
        return text, joined(prompt, new) if prompt else new

    def finish_reason(choice: Choice, out: RequestOutput) -> str | None:
        if choice.drop_output and out.finish_reason in ("stop", "length"):
            return "length"  # nothing was generated, as asked
        return out.finish_reason

    def format_choice(choice: Choice, out: RequestOutput) -> dict:
        text, lps = text_and_logprobs(choice, out, out.text, out.token_ids, out.logprobs, out.top_logprobs, True)
        return {"index": choice.index, "text": text, "finish_reason": finish_reason(choice, out), "logprobs": lps}

    def format_delta(choice: Choice, delta: Delta, first: bool) -> list[dict]:
        text, lps = text_and_logprobs(choice, delta.output, delta.text, delta.token_ids, delta.logprobs,
                                      delta.top_logprobs, first)
        if not (text or lps and lps["tokens"] or delta.finished):
            return []
        return [{"index": choice.index, "text": text, "finish_reason": finish_reason(choice, delta.output),
                 "logprobs": lps}]

    return Job(new_id("cmpl"), choices, stream, include_usage, "prompt", "text_completion", "text_completion",
               format_choice, format_delta, service.model_name, guided_field=guided_field)


