"""How much work one request may ask for, checked before any of it starts.

One request fans out into engine requests: on /v1/completions, prompts × n of them; in a Triton batch, one per row.
Without a bound, one 8 MiB body of a million tiny prompts becomes a million engine requests (and tens of GB).
Counts are checked before anything is tokenized, and so is each text prompt's size in characters (tokenizing a
7.8 MB text took 70 s and 4.9 GB); prompt tokens are summed as the prompts are tokenized (prompt_work.py runs
that off the event loop), stopping at the limit. Every refusal is a 400 (InvalidRequest, gRPC INVALID_ARGUMENT) naming the limit, the
request's value and the flag that sets it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.serve.client_json import shown
from kiln.serve.config import ServeConfig
from kiln.serve.errors import InvalidRequest

if TYPE_CHECKING:
    from kiln.runtime import Prompt

# The default of --max-prompt-chars: a prompt that fits the engine is never refused for its size unless it
# averages more than DEFAULT_CHARS_PER_TOKEN characters a token (English prose takes about 4, code about 3, and
# every token at least one byte of text), and never below MIN_DEFAULT_PROMPT_CHARS, which tokenizes in about a
# second (the 8 MiB body limit alone allows 8 million characters: some 15 s and GBs of tokenizer memory).
MIN_DEFAULT_PROMPT_CHARS = 1_000_000
DEFAULT_CHARS_PER_TOKEN = 8


def default_max_prompt_chars(max_seq_len: int) -> int:
    """The character cap of a prompt when none is configured: see DEFAULT_CHARS_PER_TOKEN."""
    return max(MIN_DEFAULT_PROMPT_CHARS, DEFAULT_CHARS_PER_TOKEN * max_seq_len)


def check_prompt_chars(what: str, size: int, limit: int, field: str, setting: str = "--max-prompt-chars") -> None:
    """Refuses a prompt of `size` characters over `limit` before it is tokenized; `what` names it in the message
    ("prompt 2", "input 'text_input'"), `setting` is what raises the limit."""
    if size > limit:
        raise InvalidRequest(f"{what} has {size} characters; this server takes at most {limit} per prompt, "
                             f"checked before tokenizing ({setting})", field)


@dataclass(frozen=True)
class RequestLimits:
    """The per-request limits of a server (ServeConfig's `max_*_per_request` and `max_n`)."""

    max_prompts: int  # prompts of one /v1/completions request
    max_n: int  # choices per prompt (OpenAI `n`)
    max_sequences: int  # engine requests one request starts: prompts × n, or Triton batch rows
    max_prompt_tokens: int  # prompt tokens of one request, each prompt counted once (as usage counts them)
    max_prompt_chars: int | None = None  # characters of one text prompt (None: default_max_prompt_chars)

    @classmethod
    def from_config(cls, config: ServeConfig) -> RequestLimits:
        return cls(max_prompts=config.max_prompts_per_request, max_n=config.max_n,
                   max_sequences=config.max_sequences_per_request,
                   max_prompt_tokens=config.max_prompt_tokens_per_request,
                   max_prompt_chars=config.max_prompt_chars)

    def prompt_chars_limit(self, max_seq_len: int) -> int:
        """The character cap of one prompt for an engine of `max_seq_len`."""
        return self.max_prompt_chars if self.max_prompt_chars is not None else default_max_prompt_chars(max_seq_len)

    def check_prompt_chars(self, what: str, size: int, field: str, max_seq_len: int) -> None:
        """A text prompt (chat: the messages' content together) of `size` characters, before it is tokenized."""
        check_prompt_chars(what, size, self.prompt_chars_limit(max_seq_len), field)

    def check_prompts(self, count: int) -> None:
        if count > self.max_prompts:
            raise InvalidRequest(f"request has {count} prompts; this server takes at most {self.max_prompts} per "
                                 "request (--max-prompts-per-request)", "prompt")

    def check_n(self, n: int) -> None:
        """`n` is an integer already (its type is the caller's check)."""
        if not 1 <= n <= self.max_n:
            raise InvalidRequest(f"n={shown(n)} is invalid: must be an integer in [1, {self.max_n}] (--max-n)", "n")

    def check_sequences(self, prompts: int, n: int) -> None:
        """`prompts` × `n` engine requests; both are within their own limits already."""
        if prompts * n > self.max_sequences:
            raise InvalidRequest(f"request asks for {prompts * n} sequences ({prompts} prompt(s) × n={n}); this "
                                 f"server takes at most {self.max_sequences} per request "
                                 "(--max-sequences-per-request)", "n")

    def check_rows(self, rows: int) -> None:
        """A Triton batch: every row is an engine request."""
        if rows > self.max_sequences:
            raise InvalidRequest(f"request has {rows} batch rows; this server takes at most {self.max_sequences} "
                                 "sequences per request (--max-sequences-per-request)", "text_input")

    def prompt_tokens(self, tokenize: Callable[[Prompt], list[int]], field: str) -> PromptTokens:
        """A counter for one request's prompts (`field` is the request's name for them)."""
        return PromptTokens(tokenize, self.max_prompt_tokens, field)


class PromptTokens:
    """Tokenizes one request's prompts in turn, refusing the request as soon as their tokens pass the limit,
    so that no more is tokenized than the limit allows (plus the one prompt that crosses it)."""

    def __init__(self, tokenize: Callable[[Prompt], list[int]], limit: int, field: str) -> None:
        self._tokenize = tokenize  # raises ValueError naming what is wrong with a prompt
        self.limit = limit
        self.field = field
        self.total = 0

    def __call__(self, prompt: Prompt) -> list[int]:
        """`prompt`'s token ids (a list of token ids is checked and counted as is)."""
        try:
            token_ids = self._tokenize(prompt)
        except ValueError as e:
            raise InvalidRequest(str(e), self.field) from None
        self.total += len(token_ids)
        if self.total > self.limit:
            raise InvalidRequest(f"request has at least {self.total} prompt tokens; this server takes at most "
                                 f"{self.limit} per request (--max-prompt-tokens-per-request)", self.field)
        return token_ids
