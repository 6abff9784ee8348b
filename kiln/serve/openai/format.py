"""Presenting kiln's results as OpenAI's objects: the legacy (completions) and chat logprobs objects, the prompt
part of completions' `echo` with `logprobs`, a stop string kept in the text (`include_stop_str_in_output`) and
`usage`. openai_request.py checks requests and builds jobs from these; nothing here speaks HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.runtime.core.outputs import RequestOutput
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.engine.detokenizer import PROMPT_CONTEXT_TOKENS

# OpenAI's and vLLM's stand-in for a logprob of -inf, which JSON cannot hold.
MIN_LOGPROB = -9999.0


def decode(tokenizer, token_ids: Sequence[int]) -> str:
    return tokenizer.decode(token_ids) if tokenizer is not None else ""


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _top(tokenizer, alternatives: dict[int, float]) -> list[tuple[str, float]]:
    ranked = sorted(alternatives.items(), key=lambda item: -item[1])
    return [(decode(tokenizer, [t]), _logprob(lp)) for t, lp in ranked]


class CompletionLogprobs:
    """Builds OpenAI's legacy logprobs object (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) piece by
    piece, as a choice streams: text offsets run on over the token strings from 0 (as vLLM's), the echoed prompt's
    tokens first. Each top_logprobs entry holds the requested alternatives and the chosen token."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.offset = 0

    def piece(self, token_ids: Sequence[int], logprobs: Sequence[float | None],
              top_logprobs: Sequence[dict[int, float] | None] | None) -> dict:
        """`logprobs[i]` None (the first prompt token): no logprob and no top_logprobs for that token."""
        tokens = [decode(self.tokenizer, [t]) for t in token_ids]
        offsets, lps, tops = [], [], []
        for i, token in enumerate(tokens):
            offsets.append(self.offset)
            self.offset += len(token)
            if logprobs[i] is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(_logprob(logprobs[i]))
            top = dict(_top(self.tokenizer, top_logprobs[i])) if top_logprobs and top_logprobs[i] else {}
            top.setdefault(token, lps[-1])
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def prompt(self, out: RequestOutput) -> dict:
        """The echoed prompt's part: each prompt token with its logprob given the ones before it (none for the
        first) and the most likely tokens at its position."""
        return self.piece(out.prompt_token_ids, out.prompt_logprobs, out.prompt_top_logprobs)


def joined(first: dict, second: dict) -> dict:
    """Two legacy logprobs objects, one after the other."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(tokenizer, token_ids, logprobs, top_logprobs) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": _logprob(logprob), "bytes": list(token.encode())}

    content = []
    for i, token_id in enumerate(token_ids):
        item = entry(decode(tokenizer, [token_id]), logprobs[i])
        item["top_logprobs"] = [entry(t, lp) for t, lp in _top(tokenizer, top_logprobs[i])] if top_logprobs else []
        content.append(item)
    return {"content": content}


def stop_string(tokenizer, params: SamplingParams, eos_token_ids: frozenset[int], out: RequestOutput) -> str:
    """The stop string that ended `out`'s text ("" when none did), for `include_stop_str_in_output`. The engine
    cuts the text right before the earliest stop string (the first listed, at equal positions) and keeps the
    token that completed it, so decoding the output tokens as the engine did shows which one it was."""
    if out.finish_reason != "stop" or not params.stop or tokenizer is None or not out.token_ids:
        return ""
    last = out.token_ids[-1]
    if (last in params.stop_token_ids or (last in eos_token_ids and not params.ignore_eos)) \
            and len(out.token_ids) > params.min_tokens:
        return ""  # ended by a stop token, not a stop string
    context = list(out.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens,
                                clean_up_tokenization_spaces=False)

    full = text(context + out.token_ids)[len(text(context)):]
    index = 0 if full.startswith(out.text) else full.find(out.text)
    if index < 0:
        return ""
    return next((s for s in params.stop if full.startswith(s, index + len(out.text))), "")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache (any tier)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
