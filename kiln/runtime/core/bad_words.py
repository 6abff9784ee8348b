"""Bad words' bookkeeping (plain Python): which tokens a request may not sample next, given its tokens so far.

A request's bad words are checked at every one of its steps, in two layers (runtime/sampling/bad_words.py
turns their answers into the sampler's token mask):

1. **Token sequences** (vLLM's and TensorRT-LLM's rule; Hugging Face generate's `bad_words_ids`): every bad
   word tokenized alone and after a space (`word_sequences`), and `bad_words_token_ids` as given. The last token
   of a sequence is banned when the tokens before it end the prompt + output so far; a one-token sequence is
   always banned.
2. **Text** (a word that tokenizes differently in context is still caught): a token is banned when its text,
   appended to the text so far, completes an occurrence of a bad word (`text_ban_prefixes`,
   `has_inner_occurrence`). A word that starts with a letter, digit or underscore counts only where it starts a
   word (the character before it is none of those), so bad_words=["def"] keeps out "def" and "default" but not
   "undefined"; any other word (" def", "!!", "中文") counts anywhere.

What is guaranteed: no bad word occurs in the generated text (an occurrence that begins in the prompt and ends
in the output included), where the text is the tokens' own texts one after another, as the detokenizer streams
them, special tokens left out. Not covered: a word whose characters are split inside a multi-byte UTF-8
character by byte-level tokens is caught in its own tokenizations only (layer 1); with guided decoding, a step
where the constraint allows nothing but banned tokens keeps the constraint's tokens (a row must allow one).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence


def is_word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


def word_sequences(word: str, encode: Callable[[str], list[int]]) -> list[tuple[int, ...]]:
    """The token sequences of `word` (vLLM's two: the word without leading spaces, and after one space);
    `encode` tokenizes without special tokens."""
    out: list[tuple[int, ...]] = []
    for text in (word.lstrip(), " " + word.lstrip()):
        ids = tuple(encode(text))
        if ids and ids not in out:
            out.append(ids)
    return out


def sequence_bans(sequences: Iterable[Sequence[int]], context: Sequence[int]) -> set[int]:
    """Layer 1: the last token of every sequence whose other tokens end `context` (prompt + output ids)."""
    banned: set[int] = set()
    n = len(context)
    for seq in sequences:
        k = len(seq) - 1
        if k == 0 or (k <= n and all(context[n - k + j] == seq[j] for j in range(k))):
            banned.add(seq[-1])
    return banned


def text_ban_prefixes(word: str, tail: str) -> list[str]:
    """Layer 2, occurrences that start at or before the next token's first character: the texts a next token
    must not start with. `tail` is the end of the text so far (at least len(word) - 1 characters when the text
    has them); where it is too short to tell what precedes, the occurrence is assumed to start a word (so the
    token is banned)."""
    needs_boundary = is_word_char(word[0])
    out = []
    for k in range(len(word)):  # k characters of the word already at the end of the text
        if k and not tail.endswith(word[:k]):
            continue
        start = len(tail) - k
        if needs_boundary and start > 0 and is_word_char(tail[start - 1]):
            continue
        out.append(word[k:])
    return out


def has_inner_occurrence(word: str, text: str) -> bool:
    """Layer 2, occurrences inside one token's text (starting after its first character): whether `text` holds
    one, word boundary included."""
    needs_boundary = is_word_char(word[0])
    j = text.find(word, 1)
    while j != -1:
        if not needs_boundary or not is_word_char(text[j - 1]):
            return True
        j = text.find(word, j + 1)
    return False


class TokenTexts:
    """Every token's own text, sorted, for layer 2: the tokens whose text starts with a prefix are one range of
    `order` (`prefix_range`). `texts[i]` is token i's text, None for a token never matched (special tokens)."""

    def __init__(self, texts: Sequence[str | None]) -> None:
        pairs = sorted((t, i) for i, t in enumerate(texts) if t)
        self.keys = [t for t, _ in pairs]
        self.order = [i for _, i in pairs]  # token ids in the order of their texts
        self.texts = texts

    def prefix_range(self, prefix: str) -> tuple[int, int]:
        """[lo, hi) of `order`: the tokens whose text starts with `prefix`."""
        lo = bisect.bisect_left(self.keys, prefix)
        hi = bisect.bisect_left(self.keys, prefix + "\U0010ffff", lo)
        return lo, hi

    def inner(self, word: str) -> list[int]:
        """The tokens whose own text holds an occurrence of `word` after its first character."""
        return [i for i, t in enumerate(self.texts) if t and word in t and has_inner_occurrence(word, t)]
