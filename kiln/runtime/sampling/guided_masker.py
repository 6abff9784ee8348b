"""Guided decoding's `TokenMasker`: one xgrammar GrammarMatcher per constrained request, whose next-token
bitmask becomes the sampler's token mask and which advances past every accepted token."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import xgrammar as xgr

from kiln.runtime.core.guided_decoding import GuidedDecoding
from kiln.runtime.core.request_failure import RequestFailed, RequestFailure
from kiln.runtime.sampling.grammar_compiler import GrammarCompiler, GrammarCompilerConfig
from kiln.runtime.sampling.sampler import SamplingRow

# Batches of at least this many constrained rows fill their bitmasks on xgrammar's thread pool (for servers
# with many cores); below it a plain loop skips the hand-off. On the 2-core dev machine the two were within
# noise of each other at 8 to 64 rows.
_BATCH_FILL_MIN_ROWS = 8


class GuidedMasker:
    """Masks constrained rows to the tokens their grammar allows next; other rows cost nothing.

    A request's matcher is made in `add_request` (so a bad constraint fails there, before the request is
    scheduled) and follows the request's output tokens through `accept`. EOS (the compiler's stop tokens) is
    allowed only where the constraint may end; once the matcher has accepted it, `accept` returns True and
    the engine ends the request. Preemption keeps a request's output tokens, so its matcher stays valid.
    """

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._batch = xgr.BatchGrammarMatcher()
        self._shifts: dict[torch.device, torch.Tensor] = {}
        # Rows the last token_mask could not mask: request id -> why (TokenMasker.take_failures).
        self._failures: dict[str, RequestFailure] = {}

    @classmethod
    def for_engine(cls, tokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                   config: GrammarCompilerConfig | None = None) -> GuidedMasker:
        """A masker (and its compiler) for an engine's tokenizer, model vocabulary and EOS ids."""
        if tokenizer is None:
            raise ValueError("guided_decoding needs the engine's tokenizer, and this engine has none")
        return cls(GrammarCompiler(tokenizer, vocab_size, eos_token_ids, config))

    def add_request(self, request_id: str, guided: GuidedDecoding) -> None:
        """Compiles (or finds cached) the request's grammar and starts its matcher; GrammarError (a
        ValueError naming the field) for a constraint that cannot be compiled."""
        grammar = self.compiler.compile(guided)
        self._matchers[request_id] = xgr.GrammarMatcher(grammar)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    # ---- TokenMasker ---------------------------------------------------------------------------
    def token_mask(self, request_ids: Sequence[str], rows: Sequence[SamplingRow], vocab_size: int,
                   device: torch.device) -> torch.Tensor | None:
        if not self._matchers:  # no constrained request at all: the common case once the masker exists
            return None
        index: list[int] = []
        matchers: list[xgr.GrammarMatcher] = []
        for i, request_id in enumerate(request_ids):
            matcher = self._matchers.get(request_id)
            if matcher is not None:
                index.append(i)
                matchers.append(matcher)
        if not matchers:
            return None
        if len(set(map(id, matchers))) != len(matchers):
            # Draft tokens would need the matcher advanced through them for each further row.
            raise NotImplementedError("guided decoding samples one row per request per step; several rows of "
                                      "one constrained request (speculative decoding) are not supported yet")
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.compiler.vocab_size)  # [N, W] int32, CPU
        self._fill(matchers, [request_ids[i] for i in index], bitmask)
        # Unpack on the logits' device: the bitmask is 32 times smaller than the bool mask to move there.
        allowed = self._unpack(bitmask.to(device, non_blocking=True), vocab_size)  # [N, V] bool
        if len(matchers) == len(rows):
            return allowed
        mask = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)
        mask[torch.tensor(index, device=device)] = allowed
        return mask

    def take_failures(self) -> dict[str, RequestFailure]:
        failures, self._failures = self._failures, {}
        return failures

    def accept(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Advances the request's matcher; True when it has terminated (accepted a stop token), so the
        request must end. A token the matcher rejects was sampled against the mask: RequestFailed (an
        internal error for that request alone)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        for token in token_ids:
            try:
                accepted = matcher.accept_token(token)
            except Exception as e:  # xgrammar raises for ids it does not know
                accepted, why = False, f": {e}"
            else:
                why = ""
            if not accepted:
                raise RequestFailed(request_id, RequestFailure(
                    f"guided decoding: sampled token {token}, which the constraint does not allow here{why}"))
        return matcher.is_terminated()

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Takes back the request's last `num_tokens` accepted tokens (rejected draft tokens)."""
        matcher = self._matchers.get(request_id)
        if matcher is not None and num_tokens:
            matcher.rollback(num_tokens)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    # ---- helpers -------------------------------------------------------------------------------
    def _fill(self, matchers: list[xgr.GrammarMatcher], request_ids: list[str], bitmask: torch.Tensor) -> None:
        """Fills row k of `bitmask` [N, W] with what matcher k allows next. A row that allows no token (a
        constraint that leads nowhere: `root ::= root`, a $ref loop) or whose matcher fails is opened to every
        token and its request recorded in `_failures`, to be ended by the engine instead of sampled against an
        empty mask."""
        try:
            if len(matchers) >= _BATCH_FILL_MIN_ROWS:
                self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
            else:
                for k, matcher in enumerate(matchers):
                    matcher.fill_next_token_bitmask(bitmask, k)
        except Exception:  # find the row that failed, one by one
            for k, matcher in enumerate(matchers):
                try:
                    matcher.fill_next_token_bitmask(bitmask, k)
                except Exception as e:
                    bitmask[k] = 0
                    self._failures[request_ids[k]] = RequestFailure(f"guided decoding failed: {e}")
        empty = (bitmask == 0).all(dim=1)  # [N] bool, on the host: a few words per row
        if bool(empty.any()):
            for k in empty.nonzero().flatten().tolist():
                bitmask[k] = -1
                self._failures.setdefault(request_ids[k], RequestFailure(
                    "guided decoding: the constraint allows no token here (it can neither continue nor end: "
                    "check it for rules or $refs that only refer to themselves)", client_error=True))

    def _unpack(self, bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[N, W] int32 bitmask (bit j of word w: token 32 w + j) -> [N, vocab_size] bool. Token ids past the
        bitmask (a model vocabulary wider than the compiler's) are disallowed."""
        shifts = self._shifts.get(bitmask.device)
        if shifts is None:
            shifts = self._shifts[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        num_rows, words = bitmask.shape
        bits = ((bitmask[:, :, None] >> shifts) & 1).view(num_rows, words * 32).bool()  # [N, 32 W]
        if bits.shape[1] >= vocab_size:
            return bits[:, :vocab_size]
        return torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)
