"""Incremental detokenization and stop-string matching for one request (plain Python, no torch)."""

from __future__ import annotations

from collections.abc import Sequence

try:  # tokenizers >= 0.21: the prefix-offset algorithm below, in Rust, one call per token
    from tokenizers.decoders import DecodeStream
except ImportError:
    DecodeStream = None

# Prompt tokens kept as decoding context, so the first output token decodes as it does mid-text
# (SentencePiece/Llama tokenizers drop the leading space of the first token of a decode). Public: serve's
# echoed prompts decode with the same context.
PROMPT_CONTEXT_TOKENS = 5
# Byte-level BPE decodes an incomplete UTF-8 sequence to this; such text is not final yet.
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one token at a time, for one request.

    Uses the prefix_offset/read_offset algorithm of vLLM and TGI: each step decodes
    `tokens[prefix_offset:]` and `tokens[prefix_offset:read_offset]` and emits the difference, unless
    it ends in an incomplete character. `tokens` starts with the last few prompt tokens as context. With a
    fast tokenizer it runs as tokenizers' DecodeStream (the same algorithm in Rust: one call a token instead
    of two decodes, ~0.7 against ~6 us); the offsets are kept alongside, so a stream that refuses a token
    (it checks that each decode extends the last) hands over to the Python steps mid-request.

    `tokenizer` is a Hugging Face tokenizer, or None (an engine without tokenizer files): then the
    text stays "" and no stop string ever matches.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer's Rust backend decodes exactly as its Python `decode` does without the cleanup
        # of spaces (which kiln turns off), at a fraction of the per-call cost: this runs twice per token.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stop = tuple(stop)
        self._skip_special_tokens = skip_special_tokens
        # A stop string can straddle the old and the new text by at most this many characters,
        # and streaming holds back this many so nothing shown is cut later.
        self._stop_overlap = max((len(s) for s in self._stop), default=1) - 1
        self._tokens: list[int] = []
        if tokenizer is not None:
            self._tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
            if self._decode(self._tokens).endswith(_REPLACEMENT_CHAR):
                # The prompt ends inside a character: its bytes would merge with the first output
                # bytes, and the output text would no longer equal decoding the output ids alone.
                self._tokens = []
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._emitted = ""  # final text: decoded up to read_offset, never changes except the stop cut
        self._stop_matched: str | None = None
        self._stream = None
        if self._backend is not None and DecodeStream is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            if self._tokens:
                self._stream.step(self._backend, list(self._tokens))  # the prompt context; its text is not output
        self._fed = len(self._tokens)  # tokens the stream has seen
        self._deferred: list[int] = []  # tokens added with `defer`, not decoded yet

    def defer(self, token_id: int) -> None:
        """Append one output token without decoding it yet: the tokens deferred are decoded together, two
        decodes in all, when the text is next read or a token is added with add_token. Only for a request
        without stop strings (nothing to find token by token), whose text nobody reads until it ends: the
        engine's final-only steps, where per-token decoding was most of the host's work per request."""
        if self._stop:
            raise RuntimeError("defer is for requests without stop strings; use add_token")
        if self._tokenizer is not None:
            self._deferred.append(token_id)

    @property
    def text(self) -> str:
        """All output text decoded so far (cut right before the stop string when one matched).

        Includes a trailing incomplete character (decoded as "\\ufffd") if the tokens so far end in
        one, so that when the request ends, `text` equals decoding all output ids at once.
        """
        self._flush()
        return self._emitted + self._pending()

    @property
    def tokenizer(self):
        """The Hugging Face tokenizer it decodes with (None: no tokenizer)."""
        return self._tokenizer

    @property
    def stop_matched(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._stop_matched

    def add_token(self, token_id: int) -> str | None:
        """Append one output token; return the stop string it completed, if any, else None.

        After a match the text ends right before the stop string and this must not be called again.
        """
        if self._stop_matched is not None:
            raise RuntimeError(
                f"add_token after stop string {self._stop_matched!r} matched; the request is finished"
            )
        if self._tokenizer is None:
            return None
        self._flush()
        self._tokens.append(token_id)
        return self._advance()

    def _flush(self) -> None:
        if self._deferred:
            self._tokens.extend(self._deferred)
            self._deferred = []
            self._advance()

    def _advance(self) -> str | None:
        """Decodes the tokens appended since read_offset (one or many: the prefix-offset algorithm takes any
        number) and returns the stop string the new text completed, if any."""
        if self._stream is not None:
            new_ids = self._tokens[self._fed:]
            self._fed = len(self._tokens)
            try:
                new_text = self._stream.step(self._backend, new_ids if len(new_ids) > 1 else new_ids[0])
            except Exception:  # e.g. a decode that does not extend the previous one: the Python steps go on
                self._stream = None
                return self._advance()
            if not new_text:
                return None  # half a character, or nothing new: wait for more tokens
        else:
            prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
            full_text = self._decode(self._tokens[self._prefix_offset:])
            if full_text.endswith(_REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text):
                return None  # not final yet (half a character, or nothing new): wait for more tokens
            new_text = full_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        search_from = max(0, len(self._emitted) - self._stop_overlap)
        self._emitted += new_text
        return self._find_stop(search_from)

    def _pending(self) -> str:
        """The text of the tokens past read_offset (they end in an incomplete character, or added nothing
        yet): decoded only when the whole text is read."""
        if self._stop_matched is not None or self._read_offset >= len(self._tokens):
            return ""
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        return self._decode(self._tokens[self._prefix_offset:])[len(prefix_text):]

    def readable_text(self, finished: bool) -> str:
        """The text that is safe to stream now.

        While not finished, holds back the last (longest stop string - 1) characters, and any
        incomplete character, so no character shown is ever cut or changed later. Once finished (or
        stopped), the whole text.
        """
        if finished or self._stop_matched is not None:
            return self.text
        self._flush()
        return self._emitted[:max(0, len(self._emitted) - self._stop_overlap)]

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def _find_stop(self, search_from: int) -> str | None:
        """Cut the text before the earliest stop string starting at or after `search_from`."""
        best_index, best_stop = -1, None
        for stop in self._stop:
            index = self._emitted.find(stop, search_from)
            if index != -1 and (best_stop is None or index < best_index):
                best_index, best_stop = index, stop
        if best_stop is not None:
            self._emitted = self._emitted[:best_index]
            self._stop_matched = best_stop
        return best_stop
