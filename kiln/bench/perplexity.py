"""Perplexity of an engine on a text, from prompt logprobs of the engine's own forward pass."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.engine.llm import LLM


@dataclass(frozen=True)
class PerplexityResult:
    """What `perplexity` measured: exp of the mean negative log-likelihood over the scored tokens."""

    perplexity: float
    mean_nll: float  # nats per scored token
    num_tokens: int  # tokens of the text that were read (BOS included when the tokenizer adds it)
    num_scored_tokens: int  # tokens with a logprob: each window's first token has no context
    num_windows: int
    window_len: int


def split_windows(token_ids: Sequence[int], window_len: int) -> list[list[int]]:
    """Consecutive, non-overlapping windows of at most window_len tokens; a window of one token scores
    nothing and is dropped."""
    if window_len < 2:
        raise ValueError(f"window_len must be at least 2 (one context token, one scored token), got {window_len}")
    windows = [list(token_ids[i:i + window_len]) for i in range(0, len(token_ids), window_len)]
    return [w for w in windows if len(w) >= 2]


def perplexity(llm: LLM, text: str | Sequence[int], *, max_tokens: int | None = None,
               window_len: int | None = None) -> PerplexityResult:
    """Scores `text` (a string, tokenized like a prompt, or token ids) with the engine.

    A text longer than one window is cut into consecutive windows, all scored in one batch; each window
    starts without context, so its first token is not scored. `window_len` defaults to the longest
    prompt the engine takes (max_seq_len - 1: one token is generated and discarded). `max_tokens` keeps
    only the text's first tokens.
    """
    if max_tokens is not None and (isinstance(max_tokens, bool) or max_tokens < 2):
        raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
    limit = llm.engine.runtime.max_seq_len - 1
    if window_len is None:
        window_len = limit
    elif window_len > limit:
        raise ValueError(f"window_len {window_len} exceeds what the engine takes (max_seq_len - 1 = {limit})")
    token_ids = llm.engine.tokenize(text)
    if max_tokens is not None:
        token_ids = token_ids[:max_tokens]
    windows = split_windows(token_ids, window_len)
    if not windows:
        raise ValueError(f"the text has {len(token_ids)} token(s); perplexity needs at least 2")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
    outputs = llm.generate(windows, params)
    logprobs = [lp for out in outputs for lp in out.prompt_logprobs[1:]]
    mean_nll = -math.fsum(logprobs) / len(logprobs)
    return PerplexityResult(perplexity=math.exp(mean_nll), mean_nll=mean_nll, num_tokens=len(token_ids),
                            num_scored_tokens=len(logprobs), num_windows=len(windows), window_len=window_len)
