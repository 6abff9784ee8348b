"""N-gram proposals (prompt lookup decoding): no model, the request's own tokens.

For n from `ngram_max` down to `ngram_min`, the last n tokens are looked up among the request's earlier
tokens; at the most recent earlier occurrence of the longest n that matches, the tokens that followed are
proposed. Code and retrieval-style prompts repeat themselves, so these drafts are often right and cost
nothing but this search.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.runtime.speculative.proposer import DraftRequest, Proposal


def lookup(tokens: Sequence[int], max_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to `max_tokens` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of length ngram_min..ngram_max; [] when none occurs earlier."""
    length = len(tokens)
    if max_tokens <= 0 or length < ngram_min + 1:
        return []
    seq = np.asarray(tokens, dtype=np.int64)  # [L]
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # windows[i] = seq[i:i+n] for starts i < L - n, i.e. every earlier occurrence that has a successor.
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the first token after the latest match
            return seq[start:start + max_tokens].tolist()
    return []


class NgramProposer:
    """`--speculative-mode ngram`: proposals looked up in each request's own prompt and output."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Proposal]:
        proposals = {}
        for r in requests:
            tokens = lookup(r.token_ids, r.max_tokens, self.ngram_min, self.ngram_max)
            if tokens:
                proposals[r.request_id] = Proposal(tokens)
        return proposals

    def release(self, request_id: str) -> None:
        pass

    def shutdown(self) -> None:
        pass
