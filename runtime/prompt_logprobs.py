"""Prompt logprobs: how likely the model found each prompt token given the ones before it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .scheduler import SchedulerOutput


def prompt_logprobs(step: SchedulerOutput, hidden: torch.Tensor, targets: dict[str, list[int]],
                    compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, tuple[int, list[float]]]:
    """hidden: [T, H], the step's packed hidden states. Returns request id -> (first position p, logprobs of
    prompt[p+1], ...) for each request in `targets` (its prompt token ids) that computed prompt tokens.
    Position p's logits predict token p+1; only prompt tokens followed by a prompt token count."""
    result: dict[str, tuple[int, list[float]]] = {}
    offset = 0
    for r in step.requests:
        n = len(r.token_ids)
        first, last = r.start_position, min(r.start_position + n, r.num_prompt_tokens - 1)
        if r.request_id in targets and last > first:
            rows = hidden[offset:offset + (last - first)]
            logprobs = torch.log_softmax(compute_logits(rows), dim=-1)  # [last-first, V]
            wanted = targets[r.request_id][first + 1:last + 1]
            picked = logprobs.gather(1, torch.tensor(wanted, device=logprobs.device)[:, None])
            result[r.request_id] = (first, picked.squeeze(1).tolist())
        offset += n
    return result
