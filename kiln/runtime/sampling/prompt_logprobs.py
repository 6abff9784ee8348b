"""Prompt logprobs: how likely the model found each prompt token given the ones before it, and (when asked)
the most likely tokens of the model's distribution at each prompt position; and context logits (the raw logits
at every prompt position), from the same rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kiln.runtime.core.scheduler import SchedulerOutput


@dataclass(frozen=True)
class PromptLogprobTarget:
    """What a request asked for: its prompt token ids (the targets that prompt positions predict) and how many
    of the most likely tokens to return per position (0: none); `logprobs`: the prompt logprobs themselves,
    `logits`: the context logits."""

    token_ids: list[int]
    top_k: int = 0
    logprobs: bool = True
    logits: bool = False


class PromptLogprobs(NamedTuple):
    """One step's prompt logprobs of one request: `logprobs[i]` is the logprob of prompt[first + 1 + i] and
    `top_logprobs[i]` (None unless asked) the top_k {token id: logprob} at that position, most likely first.
    `logits` (context logits, when asked): [k, V] float32 on the host, the raw logits of prompt positions
    first, first + 1, ... (the prompt's last position included)."""

    first: int
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None = None
    logits: torch.Tensor | None = None


def prompt_logprobs(step: SchedulerOutput, hidden: torch.Tensor, targets: dict[str, PromptLogprobTarget],
                    compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, PromptLogprobs]:
    """hidden: [T, H], the step's packed hidden states. Returns request id -> its PromptLogprobs for each request
    in `targets` that computed prompt tokens. Position p's logits predict token p+1; only prompt tokens followed
    by a prompt token count for logprobs, every prompt position for context logits. One compute_logits call per
    request and step, on every tensor-parallel rank alike (its all-gather is a collective)."""
    result: dict[str, PromptLogprobs] = {}
    offset = 0
    for r in step.requests:
        n = len(r.token_ids)
        target = targets.get(r.request_id)
        first = r.start_position
        last = min(first + n, r.num_prompt_tokens - (0 if target is not None and target.logits else 1))
        if target is not None and last > first:
            logits = compute_logits(hidden[offset:offset + (last - first)])  # [last-first, V] float32
            context = logits.to("cpu", torch.float32, copy=True) if target.logits else None
            end = min(last, r.num_prompt_tokens - 1)  # positions followed by a prompt token: [first, end)
            picked, tops = torch.empty(0, 1), None
            if target.logprobs and end > first:
                logprobs = torch.log_softmax(logits[:end - first], dim=-1)  # [end-first, V]
                wanted = target.token_ids[first + 1:end + 1]
                picked = logprobs.gather(1, torch.tensor(wanted, device=logprobs.device)[:, None])
                if target.top_k:
                    values, ids = logprobs.topk(min(target.top_k, logprobs.shape[1]), dim=-1)
                    tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            result[r.request_id] = PromptLogprobs(first, picked.squeeze(1).tolist(), tops, context)
        offset += n
    return result
