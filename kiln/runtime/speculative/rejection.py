"""The rejection rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023), batched.

A draft token d drawn from the proposer's distribution q is kept with probability min(1, p(d) / q(d)),
p being the target's distribution at that position; when it is not, the token is drawn from the residual
max(p - q, 0), normalized. The kept-or-drawn token is then distributed exactly as p, whatever q is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.plugins.host_tensors import to_device


@dataclass(frozen=True)
class DraftRows:
    """The drafts being verified in one step, by sampled row: `token_ids[r]` is the draft that row r's
    distribution decides on; `probs` ([R, V] float32) the q it was drawn from, for the rows in
    `rows_with_probs` (other rows of `probs` are unused); None when every draft is certain (q one-hot)."""

    token_ids: list[int]  # [R], -1 where a row verifies no draft (a request's last, "bonus" row)
    probs: torch.Tensor | None
    rows_with_probs: frozenset[int]

    def for_rows(self, rows: Sequence[int]) -> CheckedDrafts | None:
        """The drafts that take the rejection rule among `rows` (indices into the step's rows), as
        positions within `rows`; None when there are none."""
        if self.probs is None:
            return None
        local = [i for i, r in enumerate(rows) if r in self.rows_with_probs]
        if not local:
            return None
        device = self.probs.device
        global_rows = to_device([rows[i] for i in local], torch.int64, device)  # [N]
        return CheckedDrafts(rows=local, index=to_device(local, torch.int64, device),
                             token_ids=to_device([self.token_ids[rows[i]] for i in local], torch.int64, device),
                             probs=self.probs.index_select(0, global_rows))


@dataclass(frozen=True)
class CheckedDrafts:
    """Drafts with their q, located in a block of sampled rows."""

    rows: list[int]  # [N] positions within the block (host)
    index: torch.Tensor  # [N] int64, the same on the device
    token_ids: torch.Tensor  # [N] int64 draft tokens
    probs: torch.Tensor  # [N, V] float32: the q each draft was drawn from


def rejection_rule(target: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                   uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target: [N, V] float32 p (not necessarily normalized); draft_probs: [N, V] q (likewise);
    draft_tokens: [N] int64 d ~ q; uniforms: [N] U[0, 1).

    Returns (accept [N] bool, residual [N, V] float32): the draft is kept where accept, otherwise the token
    is a draw from residual (unnormalized; the caller's exponential race needs no normalization). A row where
    p <= q everywhere would have an empty residual; it cannot reject (p(d) / q(d) >= 1 there up to
    rounding), and falls back to p.
    """
    p = target / target.sum(dim=-1, keepdim=True)  # [N, V]
    q = draft_probs / draft_probs.sum(dim=-1, keepdim=True)  # [N, V]
    p_d = p.gather(1, draft_tokens[:, None]).squeeze(1)  # [N]
    q_d = q.gather(1, draft_tokens[:, None]).squeeze(1)  # [N]
    accept = uniforms * q_d < p_d  # P(accept) = min(1, p_d / q_d); q_d > 0 since d was drawn from q
    residual = (p - q).clamp_min(0.0)  # [N, V]
    empty = ~(residual.sum(dim=-1, keepdim=True) > 0)  # [N, 1]
    return accept, torch.where(empty, p, residual)
