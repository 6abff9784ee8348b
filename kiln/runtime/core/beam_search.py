"""Beam search's bookkeeping (plain Python, no torch): which beams run, which finished, when the search ends.

It follows Hugging Face transformers' `_beam_search` (`generate(num_beams=B, do_sample=False)`) step for step,
so kiln returns the same sequences: each step takes the K = max(2, 1 + number of stop token ids) x B best
continuations of all running beams by cumulative logprob; of those, the ones that hit a stop condition (EOS, a
stop token id or string, max_tokens) and rank among the first B become finished hypotheses scored
`cumulative_logprob / length ** length_penalty` (the B best are kept), and the B best that did not hit one run
on. The scores are float32 values rounded as HF's float32 tensors round them, so near-ties break the same way.

Each running beam is a sequence of its own in the block manager (`BeamState.table_ids`): the beams of a
request share the blocks they have in common (the prompt's first of all) by reference count, a beam that
continues another takes that beam's table, and a block two beams would both write is copied first
(`BlockManager.copy_on_write`; the scheduler hands the (src, dst) copies to the worker).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# HF's "never chosen" offset, added (in float32) to the score of a continuation that may not run on.
NEG = -1.0e9
# Separates a request id from its beams' table ids (a character no client puts in a request id).
_BEAM_SEP = "\x1f"


def beam_request_id(row_id: str) -> str | None:
    """The request a beam's row (its table id) belongs to; None for a row that is no beam's."""
    request_id, sep, _ = row_id.rpartition(_BEAM_SEP)
    return request_id if sep else None


def merge_candidates(scores: Sequence[Sequence[float]], token_ids: Sequence[Sequence[int]],
                     logprobs: Sequence[Sequence[float]], k: int) -> list[Candidate]:
    """The k best continuations over all running beams, best first, from each beam's own best (row i is beam
    i's: scores, token ids and logprobs, best first)."""
    merged = [Candidate(i, t, s, lp) for i in range(len(scores))
              for s, t, lp in zip(scores[i], token_ids[i], logprobs[i])]
    merged.sort(key=lambda c: -c.score)  # stable: ties in beam, then rank order
    return merged[:k]


def f32(x: float) -> float:
    """`x` rounded to float32, as HF's float32 tensors hold it."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass
class Beam:
    """A running beam: its generated tokens, its float32 score (the sum of its tokens' logprobs, plus NEG when
    it runs on after hitting a stop condition because too few continuations did not) and its table."""

    token_ids: list[int]
    score: float
    logprobs: list[float]
    table_id: str


@dataclass(frozen=True)
class Candidate:
    """A continuation: running beam `parent` followed by `token`; `score` = the parent's score + the token's
    logprob (float32), `logprob` the token's own."""

    parent: int
    token: int
    score: float
    logprob: float


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its tokens (the final EOS / stop token included), cumulative logprob, score and why it
    ended ("stop" or "length"); `stop_string` is the stop string it completed, if that ended it."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float
    logprobs: tuple[float, ...]
    finish_reason: str
    stop_string: str | None = None


# What ended a continuation: (finish reason, the stop string it completed or None), or None while it runs on.
Finish = tuple[str, str | None] | None


@dataclass
class BeamSearch:
    """One request's beam search over `width` beams; `max_new_tokens`: the most tokens a beam may generate."""

    width: int
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int
    num_stop_ids: int  # stop token ids (EOS ones included): K = max(2, 1 + num_stop_ids) * width
    running: list[Beam] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most `width`
    done: bool = False
    _improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied

    @property
    def num_candidates(self) -> int:
        """K: the continuations each step keeps (per beam, and over all beams)."""
        return max(2, 1 + self.num_stop_ids) * self.width

    def step(self, candidates: Sequence[Candidate], finish_of: Callable[[Candidate], Finish]) -> list[Candidate]:
        """One step: `candidates` are the K best continuations of the running beams, best first. Returns the
        continuations that run on (`width` of them; the caller forks the beams' tables accordingly), records
        the finished ones and sets `done` when the search ends."""
        width, num = self.width, len(candidates)
        finishes = [finish_of(c) for c in candidates]
        run_scores = [f32(c.score + NEG) if f is not None else c.score for c, f in zip(candidates, finishes)]
        keep = sorted(range(num), key=lambda i: -run_scores[i])[:width]  # stable: ties keep the rank order
        length = len(self.running[0].token_ids) + 1  # tokens generated, the new one included
        denominator = f32(length ** self.length_penalty)
        new = []
        for i in range(min(width, num)):  # only the first B continuations can finish (HF's top_num_beam_mask)
            finish = finishes[i]
            if finish is not None:
                c, parent = candidates[i], self.running[candidates[i].parent]
                new.append(Hypothesis((*parent.token_ids, c.token), c.score, f32(c.score / denominator),
                                      (*parent.logprobs, c.logprob), finish[0], finish[1]))
        if new:
            self.finished = sorted([*self.finished, *new], key=lambda h: -h.score)[:width]
        chosen = [candidates[i] for i in keep]
        self.running = [Beam([*self.running[c.parent].token_ids, c.token], run_scores[i],
                             [*self.running[c.parent].logprobs, c.logprob], self.running[c.parent].table_id)
                        for c, i in zip(chosen, keep)]
        self._check_done(length, all(f is not None for f in finishes))
        return chosen

    def _check_done(self, length: int, all_hit: bool) -> None:
        """HF's stopping rule: no running beam can still improve on the finished ones, or (early_stopping
        True) `width` have finished, or every continuation hit a stop condition."""
        full = len(self.finished) == self.width
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_length = self.max_new_tokens
        else:
            best_length = length
        best_possible = f32(self.running[0].score / f32(best_length ** self.length_penalty))
        worst_finished = self.finished[-1].score if full else NEG
        self._improvable = self._improvable and best_possible > worst_finished
        self.done = not self._improvable or (full and self.early_stopping is True) or all_hit

    def results(self) -> list[Hypothesis]:
        """The `width` best finished beams, best first (running ones fill in, scored likewise, should fewer
        have finished)."""
        if len(self.finished) >= self.width or not self.running:
            return list(self.finished)
        length = len(self.running[0].token_ids)
        denominator = f32(max(length, 1) ** self.length_penalty)
        extra = [Hypothesis(tuple(b.token_ids), b.score, f32(b.score / denominator), tuple(b.logprobs), "length")
                 for b in self.running]
        return sorted([*self.finished, *extra], key=lambda h: -h.score)[:self.width]


class BeamState:
    """A beam-search request's beams as the scheduler and block manager see them: one block table per running
    beam (`table_ids`, the ids of the rows its steps compute), advanced in lockstep (every beam holds as many
    tokens, and the request's `num_computed_tokens` counts each one's)."""

    def __init__(self, request_id: str, search: BeamSearch) -> None:
        self.request_id = request_id
        self.search = search
        self._ids = itertools.count()
        search.running = [Beam([], 0.0, [], self._new_id())]

    @classmethod
    def start(cls, request_id: str, params, eos_token_ids: frozenset[int]) -> BeamState:
        """The beams of a request just added (`params`: its SamplingParams with use_beam_search)."""
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        return cls(request_id, BeamSearch(params.n, params.length_penalty, params.early_stopping,
                                          params.max_tokens, len(stop_ids)))

    def _new_id(self) -> str:
        return f"{self.request_id}{_BEAM_SEP}beam{next(self._ids)}"

    @property
    def table_ids(self) -> list[str]:
        return [beam.table_id for beam in self.search.running]

    @property
    def output_token_ids(self) -> list[int]:
        """The first running beam's tokens (every beam holds as many)."""
        return self.search.running[0].token_ids

    def token_slice(self, index: int, prompt: Sequence[int], start: int, end: int) -> list[int]:
        """(prompt + beam `index`'s tokens)[start:end]."""
        output = self.search.running[index].token_ids
        n = len(prompt)
        if end <= n:
            return list(prompt[start:end])
        if start >= n:
            return output[start - n:end - n]
        return list(prompt[start:]) + output[:end - n]

    def fork(self, blocks, chosen: Sequence[Candidate], parent_tables: Sequence[str]) -> None:
        """After `BeamSearch.step` chose the running beams (`chosen`, from the beams whose tables were
        `parent_tables`): the first continuation of a beam takes its table, each further one shares its blocks
        (`BlockManager.fork`), and a beam nobody continues gives its blocks back. `blocks`: the BlockManager."""
        first: dict[int, int] = {}  # parent -> its first continuation, which takes the parent's table
        for j, c in enumerate(chosen):
            first.setdefault(c.parent, j)
        for j, (beam, c) in enumerate(zip(self.search.running, chosen)):
            beam.table_id = self._new_id()
            if first[c.parent] != j:
                blocks.fork(parent_tables[c.parent], beam.table_id)
        for parent, j in first.items():  # after the forks, which read the parents' tables
            blocks.rename(parent_tables[parent], self.search.running[j].table_id)
        for i, table_id in enumerate(parent_tables):
            if i not in first:
                blocks.free(table_id)

    def free(self, blocks) -> None:
        """Gives back every beam's blocks (the request ended or was preempted)."""
        for table_id in self.table_ids:
            blocks.free(table_id)
