"""`SamplingParams.min_tokens`: until a request has that many output tokens, EOS and its stop token ids
cannot be sampled (vLLM's meaning), through the sampler's token-mask stage."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.runtime.sampling.sampler import SamplingRow


def apply_min_tokens(mask: torch.Tensor | None, rows: Sequence[SamplingRow], eos_token_ids: frozenset[int],
                     vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """`mask` ([R, V] bool or None) with EOS and stop token ids turned off in the rows still short of their
    min_tokens. Row i samples output token len(rows[i].output_token_ids) + (its index among its request's
    rows). Returns `mask` unchanged (no allocation) when no row is short, the common case.

    A row of `mask` (guided decoding) that allows nothing but EOS and stop ids keeps them: the constraint is
    complete, and ending is better than an empty row, from which the sampler could pick no valid token."""
    banned: list[tuple[int, list[int]]] = []
    seen: dict[int, int] = {}  # id(output list) -> rows of that request so far in this step
    for i, row in enumerate(rows):
        params = row.params
        if not params.min_tokens:
            continue
        k = seen.get(id(row.output_token_ids), 0)
        seen[id(row.output_token_ids)] = k + 1
        if len(row.output_token_ids) + k < params.min_tokens:
            ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
            ids = [t for t in ids if 0 <= t < vocab_size]
            if ids:
                banned.append((i, ids))
    if not banned:
        return mask
    before = None if mask is None else mask.clone()
    if mask is None:
        mask = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)
    for i, ids in banned:
        mask[i, torch.tensor(ids, device=device)] = False
    if before is None:
        return mask
    emptied = ~mask.any(dim=1, keepdim=True)  # [R, 1]; no host sync
    return torch.where(emptied, before, mask)
