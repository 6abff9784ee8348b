"""The sampler's bad-words stage: `SamplingParams.bad_words` / `bad_words_token_ids` as a token mask, and the
checks that turn a request's word lists into what the engine runs (`WordBans.prepare`).

What is banned and what is guaranteed: runtime/core/bad_words.py. A step without such requests costs one pass
over its rows; a request with bad words costs, per step, one decode of its last few tokens and a few prefix
lookups per word. The table of every token's text is made on the first request with bad words.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kiln.runtime.core.bad_words import TokenTexts, sequence_bans, text_ban_prefixes, word_sequences
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.sampling.sampler import SamplingRow

_CACHE_LIMIT = 512  # compiled word lists kept (requests often share theirs)
# TensorRT-LLM's input names of the fields, for messages that clients of the Triton door read.
_TRTLLM_NAMES = {"bad_words_token_ids": "bad_words_list", "stop_token_sequences": "stop_words_list"}


@dataclasses.dataclass(frozen=True)
class _Compiled:
    words: tuple[str, ...]
    sequences: tuple[tuple[int, ...], ...]  # layer 1: the words' tokenizations + bad_words_token_ids
    inner: torch.Tensor  # [N] int64: tokens always banned (a word inside their own text)
    tail_tokens: int  # how many last tokens to decode for layer 2


class WordBans:
    """Bans, at every step, the tokens that would complete a request's bad word (see runtime/core/bad_words.py).

    `tokenizer` is a Hugging Face tokenizer (None: an engine without one, where only bad_words_token_ids work);
    `vocab_size` the model's (the logits' width)."""

    def __init__(self, tokenizer, vocab_size: int, special_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.special_ids = frozenset(special_ids)
        self._texts: TokenTexts | None = None
        self._order: torch.Tensor | None = None  # TokenTexts.order as a tensor
        self._compiled: dict[tuple, _Compiled] = {}

    def prepare(self, params: SamplingParams) -> SamplingParams:
        """Checks a request's token ids against the vocabulary (a ValueError naming the field) and turns
        `stop_token_sequences` into what the engine stops on: a one-token sequence into stop_token_ids, a longer
        one into the stop string of its text (matched on text, like every stop string). Compiles its bad words."""
        v = self.vocab_size
        for name in ("bad_words_token_ids", "stop_token_sequences"):
            for seq in getattr(params, name):
                if any(t >= v for t in seq):
                    raise ValueError(f"SamplingParams.{name}={list(seq)!r} is invalid: token ids must be < the "
                                     f"model's vocabulary size {v} ({_TRTLLM_NAMES[name]} at the Triton door)")
        for token in params.logit_bias or ():
            if token >= v:
                raise ValueError(f"SamplingParams.logit_bias={token!r} is invalid: token ids must be < the model's "
                                 f"vocabulary size {v} (embedding_bias at the Triton door: at most {v} entries)")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs the engine's tokenizer; this engine has none (send "
                             "token ids in bad_words_token_ids)")
        if params.stop_token_sequences:
            single = tuple(seq[0] for seq in params.stop_token_sequences if len(seq) == 1)
            longer = [seq for seq in params.stop_token_sequences if len(seq) > 1]
            if longer and self.tokenizer is None:
                raise ValueError("SamplingParams.stop_token_sequences of several tokens need the engine's tokenizer")
            texts = tuple(t for t in (self.tokenizer.decode(list(seq)) for seq in longer) if t)
            params = dataclasses.replace(params, stop_token_sequences=(), stop=params.stop + texts,
                                         stop_token_ids=params.stop_token_ids + single)
        if params.has_word_bans:
            self._compile(params)
        return params

    def apply(self, mask: torch.Tensor | None, rows: Sequence[SamplingRow], vocab_size: int,
              device: torch.device) -> torch.Tensor | None:
        """`mask` ([R, V] bool or None) with every row's banned tokens turned off; returned unchanged (no
        allocation) when no row has bad words. A row of `mask` (guided decoding) left empty keeps its tokens."""
        row_index: list[torch.Tensor] = []
        token_index: list[torch.Tensor] = []
        for i, row in enumerate(rows):
            if not row.params.has_word_bans:
                continue
            banned = self._row_bans(row)
            token_index.append(banned)
            row_index.append(torch.full_like(banned, i))
        if not row_index:
            return mask
        before = mask
        mask = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device) if mask is None else mask.clone()
        mask[_to_device(torch.cat(row_index), device), _to_device(torch.cat(token_index), device)] = False
        if before is None:
            return mask
        emptied = ~mask.any(dim=1, keepdim=True)  # [R, 1]; no host sync
        return torch.where(emptied, before, mask)

    # ---- internals ----------------------------------------------------------------------------------
    def _row_bans(self, row: SamplingRow) -> torch.Tensor:
        """[N] int64 on the CPU: the tokens row `row` may not sample (may repeat)."""
        params = row.params
        compiled = self._compile(params)
        context = [*row.prompt_token_ids, *row.output_token_ids]
        parts = [compiled.inner]
        ids = sequence_bans(compiled.sequences, context)
        if ids:
            parts.append(torch.tensor(sorted(ids), dtype=torch.int64))
        if compiled.words:
            tail = self.tokenizer.decode(context[-compiled.tail_tokens:],
                                         skip_special_tokens=params.skip_special_tokens)
            for word in compiled.words:
                for prefix in text_ban_prefixes(word, tail):
                    lo, hi = self._texts.prefix_range(prefix)
                    if hi > lo:
                        parts.append(self._order[lo:hi])
        return torch.cat(parts)

    def _compile(self, params: SamplingParams) -> _Compiled:
        key = (params.bad_words, params.bad_words_token_ids)
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        sequences = list(params.bad_words_token_ids)
        inner: set[int] = set()
        if params.bad_words:
            texts = self._token_texts()
            for word in params.bad_words:
                sequences += [s for s in word_sequences(word, self._encode) if s not in sequences]
                inner.update(texts.inner(word))
        longest = max((len(w) for w in params.bad_words), default=0)
        compiled = _Compiled(params.bad_words, tuple(sequences), torch.tensor(sorted(inner), dtype=torch.int64),
                             tail_tokens=longest + 8)
        if len(self._compiled) >= _CACHE_LIMIT:
            self._compiled.clear()
        self._compiled[key] = compiled
        return compiled

    def _encode(self, text: str) -> list[int]:
        return [t for t in self.tokenizer.encode(text, add_special_tokens=False) if t < self.vocab_size]

    def _token_texts(self) -> TokenTexts:
        """Every token's own text as it reads after other text (decoded after an anchor token, so that a
        tokenizer that drops a leading space at the start of a text keeps it), special tokens left out."""
        if self._texts is None:
            tok = self.tokenizer
            n = min(len(tok), self.vocab_size)
            special = self.special_ids | set(getattr(tok, "all_special_ids", ()))
            anchor = self._encode("a")[-1:]
            head = tok.decode(anchor) if anchor else ""
            pairs = tok.batch_decode([[*anchor, i] for i in range(n)], clean_up_tokenization_spaces=False)
            texts: list[str | None] = [
                None if i in special else (t[len(head):] if t.startswith(head) else tok.decode([i]))
                for i, t in enumerate(pairs)]
            self._texts = TokenTexts(texts)
            self._order = torch.tensor(self._texts.order, dtype=torch.int64)
        return self._texts


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` through pinned memory and a non-blocking copy, so that masking does not wait
    for the step's forward pass queued before it (host_tensors.to_device's rule)."""
    return tensor if device.type == "cpu" else tensor.pin_memory().to(device, non_blocking=True)
