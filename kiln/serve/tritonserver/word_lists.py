"""TensorRT-LLM's word inputs -> SamplingParams' fields: bad_words (strings), bad_words_list and stop_words_list
(token ids), embedding_bias.

`bad_words_list` / `stop_words_list` take TensorRT-LLM's layout, as its preprocessing model's
`_to_word_list_format` makes it: per row a [2, L] INT32 tensor, row 0 the words' token ids one after another
(padded with 0), row 1 the cumulative end offset of each word (padded with -1). `embedding_bias` is FP32
[vocab]: added to the logits (kiln's logit_bias, its non-zero entries); an empty one is none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from kiln.serve.errors import InvalidRequest


def word_list_kwargs(row: Mapping[str, np.ndarray], text: Callable[[str, object], str]) -> dict:
    """One batch row's word inputs -> SamplingParams keyword arguments (none when absent). `text` decodes a
    BYTES element naming its input (request.py's `_text`). Empty strings in bad_words are ignored, as in
    stop_words."""
    kwargs: dict = {}
    bad = tuple(s for s in (text("bad_words", v) for v in row.get("bad_words", ())) if s)
    if bad:
        kwargs["bad_words"] = bad
    for name, field in (("bad_words_list", "bad_words_token_ids"), ("stop_words_list", "stop_token_sequences")):
        if name in row:
            sequences = parse_word_list(name, row[name])
            if sequences:
                kwargs[field] = sequences
    if "embedding_bias" in row:
        bias = embedding_bias(row["embedding_bias"])
        if bias:
            kwargs["logit_bias"] = bias
    return kwargs


def parse_word_list(name: str, array: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """A [2, L] word list (TensorRT-LLM's layout) -> its token-id sequences; InvalidRequest naming `name` for a
    malformed one."""
    array = np.asarray(array)
    if array.ndim != 2 or array.shape[0] != 2:
        raise InvalidRequest(f"input '{name}' has shape {list(array.shape)} per row; expected [2, len] (row 0 the "
                             "words' token ids, row 1 their end offsets, padded with -1)", name)
    ids, offsets = array[0].tolist(), array[1].tolist()
    ends = []
    for offset in offsets:
        if offset < 0:  # padding: the words end here
            break
        ends.append(offset)
    sequences = []
    start = 0
    for end in ends:
        if not start < end <= len(ids):
            raise InvalidRequest(f"input '{name}': offsets {ends} must increase and stay within the {len(ids)} "
                                 f"token ids (each offset is where a word ends)", name)
        sequences.append(tuple(int(t) for t in ids[start:end]))
        start = end
    if any(t < 0 for seq in sequences for t in seq):
        raise InvalidRequest(f"input '{name}' holds a negative token id", name)
    return tuple(sequences)


def embedding_bias(array: np.ndarray) -> dict[int, float] | None:
    """FP32 [vocab] -> {token id: bias} of its non-zero entries; None when empty or all zero."""
    values = np.asarray(array, dtype=np.float32).reshape(-1)
    nonzero = np.flatnonzero(values)
    if not nonzero.size:
        return None
    return {int(i): float(values[i]) for i in nonzero}
