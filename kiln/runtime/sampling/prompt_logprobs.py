"""Prompt logprobs: how likely the model found each prompt token given the ones before it, and (when asked)
the most likely tokens of the model's distribution at each prompt position."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kiln.runtime.core.scheduler import SchedulerOutput


@dataclass(frozen=True)
class PromptLogprobTarget:
    """What a request asked for: its prompt token ids (the targets that prompt positions predict) and how many
    of the most likely tokens to return per position (0: none)."""

    token_ids: list[int]
    top_k: int = 0


class PromptLogprobs(NamedTuple):
    """One step's prompt logprobs of one request: `logprobs[i]` is the logprob of prompt[first + 1 + i] and
    `top_logprobs[i]` (None unless asked) the top_k {token id: logprob} at that position, most likely first."""

    first: int
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None = None


def prompt_logprobs(step: SchedulerOutput, hidden: torch.Tensor, targets: dict[str, PromptLogprobTarget],
                    compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, PromptLogprobs]:
    """hidden: [T, H], the step's packed hidden states. Returns request id -> its PromptLogprobs for each request
    in `targets` that computed prompt tokens. Position p's logits predict token p+1; only prompt tokens followed
    by a prompt token count."""
    result: dict[str, PromptLogprobs] = {}
    offset = 0
    for r in step.requests:
        n = len(r.token_ids)
        first, last = r.start_position, min(r.start_position + n, r.num_prompt_tokens - 1)
        target = targets.get(r.request_id)
        if target is not None and last > first:
            rows = hidden[offset:offset + (last - first)]
            logprobs = torch.log_softmax(compute_logits(rows), dim=-1)  # [last-first, V]
            wanted = target.token_ids[first + 1:last + 1]
            picked = logprobs.gather(1, torch.tensor(wanted, device=logprobs.device)[:, None])
            tops = None
            if target.top_k:
                values, ids = logprobs.topk(min(target.top_k, logprobs.shape[1]), dim=-1)
                tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            result[r.request_id] = PromptLogprobs(first, picked.squeeze(1).tolist(), tops)
        offset += n
    return result
