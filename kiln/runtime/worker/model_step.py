"""What crosses the executor boundary: a plain-data step in, logits out.

`StepInput` is what rank 0 would send to every other rank of a tensor-parallel engine (plain Python, no
tensors, except a `TokenFeed`, which only a local executor takes; `distributed/step_codec.py` gives it its
wire form, so a field added here needs one there); `StepResult` is what the engine samples from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.runtime.core.scheduler import SchedulerOutput
from kiln.runtime.sampling.prompt_logprobs import PromptLogprobs, PromptLogprobTarget


@dataclass(frozen=True)
class TokenFeed:
    """Async scheduling: the tokens the step before sampled, still on the device, that this step's
    PLACEHOLDER input tokens stand for. Scheduled request i's last token is tokens[rows[i]] where rows[i] >= 0
    (its token_ids end with the PLACEHOLDER); -1: its tokens are all known."""

    tokens: torch.Tensor  # [B] int64 on the runtime device: the previous step's sampled tokens
    rows: tuple[int, ...]  # per scheduled request


@dataclass(frozen=True)
class StepInput:
    schedule: SchedulerOutput
    # request id -> its prompt token ids (the targets that this step's prompt positions predict) and how many
    # top tokens per position, for the requests that asked for prompt logprobs.
    prompt_logprob_targets: dict[str, PromptLogprobTarget] = field(default_factory=dict)
    token_feed: TokenFeed | None = None  # None: every input token is known on the host


@dataclass(frozen=True)
class StepResult:
    logits: torch.Tensor  # [R, V] float32: the sampled positions of every request, in schedule order
    request_ids: tuple[str, ...]  # the scheduled requests, in schedule order
    # Request i's sampled rows are logits[logits_offsets[i]:logits_offsets[i + 1]] (none for a prefill
    # chunk that does not reach the end of its prompt); the last entry is R.
    logits_offsets: tuple[int, ...]
    # request id -> (first prompt position p, logprobs of prompt[p+1], prompt[p+2], ..., their positions' top
    # tokens when asked) for requests that asked for prompt logprobs and computed prompt tokens this step.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # EAGLE-3: [T, len(layers) * H] in the model's dtype, every computed token's residual streams at the layers
    # `capture_hidden` named (the packed tokens in schedule order), concatenated; None when none were asked for.
    aux_hidden: torch.Tensor | None = None

    def rows_of(self, index: int) -> range:
        """The logits rows of the `index`-th scheduled request."""
        return range(self.logits_offsets[index], self.logits_offsets[index + 1])
